"""Checkpoints whose names carry the ``module.`` of a wrapper around the model.

Before ``dp`` extended the model in place, it wrapped it (``DataParallel.module``): its
checkpoints name every model tensor ``module.<name>`` (DCP keys ``model.module.<name>``
and ``optim.state.module.<name>...``, the manifest's tensor names, the optimizer's
``param_groups[i]["params"]``); so does one saved from a model wrapped in torch DDP.
:func:`wrapper_prefix` recognizes such a checkpoint for a model whose own names lack the
prefix, and :func:`as_saved` / :func:`as_model` rename the state :class:`CheckpointManager`
loads into, so that DCP finds the saved names and the model gets its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

#: The prefix of the names in a checkpoint of a wrapped model.
WRAPPER = "module."

_V = TypeVar("_V")


def wrapper_prefix(saved: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """``"module."`` when every saved model tensor name has it and none of the model's
    names has (a checkpoint of the model inside a wrapper), else ``""``."""
    if not saved or any(n.startswith(WRAPPER) for n in model):
        return ""
    return WRAPPER if all(n.startswith(WRAPPER) for n in saved) else ""


def strip(names: Mapping[str, _V], prefix: str) -> dict[str, _V]:
    """``names`` with ``prefix`` removed from each key."""
    return {k.removeprefix(prefix): v for k, v in names.items()}


def as_saved(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (``get_state_dict``'s, the model's own names) under
    the names a checkpoint with ``prefix`` holds; the tensors are the same objects, so a
    DCP load into the result loads into the model's state."""
    if not prefix:
        return state
    return {
        "model": {prefix + k: v for k, v in state["model"].items()},
        "optim": _renamed_optim(state["optim"], lambda name: prefix + name),
    }


def as_model(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The inverse of :func:`as_saved`: the state under the model's own names (the
    values DCP loaded, the saved ``param_groups`` included)."""
    if not prefix:
        return state
    return {
        "model": strip(state["model"], prefix),
        "optim": _renamed_optim(state["optim"], lambda name: name.removeprefix(prefix)),
    }


def _renamed_optim(optim: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """An optimizer state dict by parameter name (``get_state_dict``'s) with every
    parameter name passed through ``rename``."""
    out = dict(optim)
    if "state" in optim:
        out["state"] = {rename(k): v for k, v in optim["state"].items()}
    if "param_groups" in optim:
        out["param_groups"] = [
            {**group, "params": [rename(p) for p in group["params"]]}
            if "params" in group
            else dict(group)
            for group in optim["param_groups"]
        ]
    return out


__all__ = ["WRAPPER", "as_model", "as_saved", "strip", "wrapper_prefix"]
