"""A stock ``torch.optim`` optimizer's update as a traceable function: what a compiled
step (:mod:`.step`) puts in its graph after the gradients' collectives.

``torch.optim``'s ``step()`` always breaks a ``torch.compile`` graph (it toggles grad mode
around a graph break) and refuses parameters whose gradient the same graph computes. The
update itself is torch's own: the module-level functions ``torch.optim.sgd.sgd`` and
``torch.optim.adam.adam`` that ``SGD``, ``Adam`` and ``AdamW`` call, given the
optimizer's ``param_groups`` hyperparameters and its ``state`` tensors. The state lives
in ``optimizer.state`` under torch's own keys, created as torch creates it, so
``optimizer.state_dict()``, checkpoints and LR schedulers see the optimizer the user
built. Learning rates enter the graph as 0-dim tensors, so a scheduler changing them does
not recompile. An optimizer or setting this module does not cover is named, with the
reason, by :func:`unsupported_reason`.

The graph is handed the tensors it updates (:meth:`FunctionalOptimizer.tensors`): the
parameters and their state tensors, or, for sharded parameters (``DTensor``), their local
shards, so the update is the same element-wise arithmetic on what this rank holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update

#: The optimizer classes whose update is traced (``AdamW`` is ``Adam`` with decoupled
#: weight decay).
SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str:
    """'' when the optimizer's update can be traced; else why not, in one line."""
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(c.__name__ for c in SUPPORTED)
        return f"{type(optimizer).__name__} is not one of {names}"
    for group in optimizer.param_groups:
        if group.get("foreach") or group.get("fused") or group.get("differentiable"):
            return "foreach=, fused= and differentiable= optimizers are not traced"
        if group.get("maximize"):
            return "maximize=True is not traced"
        if isinstance(optimizer, torch.optim.SGD) and group["momentum"] and group["dampening"]:
            return "SGD with momentum and dampening starts its buffer from the first gradient"
        if isinstance(optimizer, torch.optim.SGD) and group["nesterov"]:
            return "SGD with nesterov=True is not traced"
        if not isinstance(optimizer, torch.optim.SGD) and group["amsgrad"]:
            return "amsgrad=True is not traced"
    return ""


def trained(group: dict[str, object]) -> list[torch.Tensor]:
    """The group's parameters that require grad (torch skips the frozen ones, whose
    gradient stays None)."""
    params = group["params"]
    assert isinstance(params, list)
    return [p for p in params if p.requires_grad]


#: What the update runs on for one parameter: the tensor itself, or its local shard.
Local = Callable[[torch.Tensor], torch.Tensor]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class GroupSettings:
    """One optimizer group's settings besides its learning rate, as plain numbers."""

    weight_decay: float
    momentum: float = 0.0
    dampening: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    decoupled: bool = False


@dataclass
class UpdatedTensors:
    """Per optimizer group: the tensors its update writes in place (graph inputs), the
    parameters and each one's state tensors under torch's keys."""

    params: list[list[torch.Tensor]]
    states: list[list[dict[str, torch.Tensor]]]


class FunctionalOptimizer:
    """``optimizer``'s update over its own state (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.adam = not isinstance(optimizer, torch.optim.SGD)
        #: Each group's settings as :meth:`learning_rates` last read them.
        self.settings: tuple[GroupSettings, ...] = ()

    def init_state(self, steps_on: torch.device | None = None) -> None:
        """Create every parameter's state as torch creates it (SGD's momentum buffer as
        zeros: with no dampening its first update gives the first gradient, as torch's
        copy of it does). ``steps_on``: Adam's step counters live there (a device graph
        replays only device work), existing ones moved."""
        for group in self.optimizer.param_groups:
            for p in trained(group):
                state = self.optimizer.state[p]
                if state:
                    if steps_on is not None and "step" in state:  # a captured step counts
                        state["step"] = state["step"].to(steps_on)
                    continue
                if self.adam:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32, device=steps_on)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif group["momentum"]:
                    state["momentum_buffer"] = torch.zeros_like(p)

    def _decoupled(self, group: dict[str, object]) -> bool:
        """AdamW's weight decay (a group key since torch made AdamW an Adam)."""
        default = isinstance(self.optimizer, torch.optim.AdamW)
        return bool(group.get("decoupled_weight_decay", default))

    def learning_rates(self, device: torch.device | None = None) -> list[torch.Tensor]:
        """Each group's current learning rate as a 0-dim tensor (a graph input), and its
        other settings read again (:attr:`settings`): the graph reads no ``param_groups``
        dict, whose every value it would otherwise guard on (a scheduler's new learning
        rate would compile the step again)."""
        groups = self.optimizer.param_groups
        self.settings = tuple(self._settings(g) for g in groups)
        return [torch.tensor(float(g["lr"]), dtype=torch.float32, device=device) for g in groups]

    def _settings(self, group: dict[str, Any]) -> GroupSettings:
        if self.adam:
            beta1, beta2 = group["betas"]
            return GroupSettings(
                float(group["weight_decay"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                decoupled=self._decoupled(group),
            )
        return GroupSettings(
            float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
        )

    def tensors(self, local: Local = _same) -> UpdatedTensors:
        """The trained parameters (:func:`trained`) and state tensors of every group,
        each through ``local`` (its local shard for a sharded parameter); the step
        counters stay as they are."""
        params: list[list[torch.Tensor]] = []
        states: list[list[dict[str, torch.Tensor]]] = []
        for group in self.optimizer.param_groups:
            params.append([local(p) for p in trained(group)])
            states.append(
                [
                    {k: v if k == "step" else local(v) for k, v in self.optimizer.state[p].items()}
                    for p in trained(group)
                ]
            )
        return UpdatedTensors(params, states)

    def update(
        self,
        tensors: UpdatedTensors,
        grads: Sequence[Sequence[torch.Tensor]],
        lrs: Sequence[torch.Tensor],
    ) -> None:
        """Apply one step in place on ``tensors``: ``grads[i]`` are group i's parameters'
        gradients, in order."""
        with torch.no_grad():
            for group, params, states, group_grads, lr in zip(
                self.settings, tensors.params, tensors.states, grads, lrs, strict=True
            ):
                if self.adam:
                    adam_update(
                        params,
                        list(group_grads),
                        [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states],
                        [],
                        [s["step"] for s in states],
                        foreach=False,
                        decoupled_weight_decay=group.decoupled,
                        amsgrad=False,
                        beta1=group.beta1,
                        beta2=group.beta2,
                        lr=lr,
                        weight_decay=group.weight_decay,
                        eps=group.eps,
                        maximize=False,
                    )
                else:
                    buffers = [s.get("momentum_buffer") for s in states]
                    sgd_update(
                        params,
                        list(group_grads),
                        buffers,
                        foreach=False,
                        weight_decay=group.weight_decay,
                        momentum=group.momentum,
                        lr=lr,  # type: ignore[arg-type]  # a 0-dim tensor: no recompile
                        dampening=group.dampening,
                        nesterov=False,
                        maximize=False,
                    )
