"""The state dict of a model whose parameters a strategy cut across an axis:
:class:`SplitStateModule`.

Tensor parallelism cuts layers, expert parallelism cuts an MoE layer's stacked experts;
either way a parameter holds this rank's piece, and :class:`~lamina.strategies.tp.state.
GlobalViews` turns it into the whole tensor's ``DTensor`` for ``state_dict()`` (and an
optimizer's state for a checkpoint) and back on load, so ``torch.distributed.checkpoint``
moves it across layouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lamina.strategies.surface import DistributedModule

if TYPE_CHECKING:
    from lamina.strategies.tp.state import GlobalViews


class SplitStateModule(DistributedModule):
    """torch's state-dict methods in whole-tensor terms for the parameters a strategy cut;
    a strategy's module class derives from it and defines a ``split_views`` property (its
    :class:`~lamina.strategies.tp.state.GlobalViews`)."""

    def _every_split(self) -> _Views:
        """The views of every strategy that cut this model's parameters (``tp`` and
        ``ep`` composed: each its own), as each module class's ``split_views`` gives them."""
        return _Views(
            [
                cls.__dict__["split_views"].fget(self)
                for cls in type(self).__mro__
                if "split_views" in cls.__dict__
            ]
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """torch's ``state_dict``, each split parameter a ``DTensor`` of the whole tensor
        (:mod:`.state`; ``keep_vars=True``: the parameters themselves)."""
        state = super().state_dict(*args, **kwargs)
        if kwargs.get("keep_vars") or (len(args) > 2 and args[2]):
            return state
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        views = self._every_split()
        for key in list(state):
            state[key] = views.to_global(key[len(prefix) :], state[key])
        return state

    def optimizer_state_to_global(self, optim_state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state dict by parameter name (``get_state_dict``'s) with each
        split parameter's state tensors as whole-tensor DTensors, as its parameter is in
        ``state_dict()``: what a checkpoint saves (collective, as saving is)."""
        return _map_optimizer(optim_state, self._every_split().to_global)

    def optimizer_state_to_local(self, optim_state: dict[str, Any]) -> dict[str, Any]:
        """:meth:`optimizer_state_to_global` undone: each state tensor in its parameter's
        own form (this rank's piece), for ``set_state_dict``."""
        targets = super().state_dict(keep_vars=True)
        views = self._every_split()

        def local(name: str, value: Any) -> Any:
            target = targets.get(name)
            return value if target is None else views.to_local(name, value, target)

        return _map_optimizer(optim_state, local)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """torch's ``load_state_dict``, from whole-tensor DTensors (a checkpoint of
        any layout) or whole plain tensors: each rank keeps its piece."""
        targets = super().state_dict(keep_vars=True)
        views = self._every_split()
        state = {
            key: views.to_local(key, value, targets[key]) if key in targets else value
            for key, value in state_dict.items()
        }
        return super().load_state_dict(state, strict=strict, assign=assign)


class _Views:
    """Several strategies' views, each serving the parameters it cut."""

    def __init__(self, views: list[GlobalViews]) -> None:
        self.views = views

    def _of(self, name: str) -> GlobalViews | None:
        return next((v for v in self.views if name in v.splits), None)

    def to_global(self, name: str, value: torch.Tensor) -> torch.Tensor:
        views = self._of(name)
        return value if views is None else views.to_global(name, value)

    def to_local(self, name: str, value: Any, target: torch.Tensor) -> Any:
        views = self._of(name)
        return value if views is None else views.to_local(name, value, target)


def _map_optimizer(optim_state: dict[str, Any], fn: Any) -> dict[str, Any]:
    """``optim_state`` with ``fn(name, tensor)`` applied to every per-parameter state
    tensor shaped like its parameter (scalars such as Adam's ``step`` stay)."""
    mapped: dict[str, Any] = {}
    for name, entry in optim_state.get("state", {}).items():
        mapped[name] = {
            key: fn(name, value) if isinstance(value, torch.Tensor) and value.dim() else value
            for key, value in entry.items()
        }
    return {**optim_state, "state": mapped}


__all__ = ["SplitStateModule"]
