"""A stock ``torch.optim`` optimizer's update as a traceable function: what the compiled
step (:mod:`.compiled_step`) puts in its graph after the gradients' all-reduces.

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
"""

from __future__ import annotations

from collections.abc import Sequence

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


class FunctionalOptimizer:
    """``optimizer``'s update over its own state (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.adam = not isinstance(optimizer, torch.optim.SGD)

    def init_state(self) -> None:
        """Create every parameter's state as torch creates it (SGD's momentum buffer as
        zeros: with no dampening its first update gives the first gradient, as torch's
        copy of it does)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state[p]
                if state:
                    continue
                if self.adam:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif group["momentum"]:
                    state["momentum_buffer"] = torch.zeros_like(p)

    def _decoupled(self, group: dict[str, object]) -> bool:
        """AdamW's weight decay (a group key since torch made AdamW an Adam)."""
        default = isinstance(self.optimizer, torch.optim.AdamW)
        return bool(group.get("decoupled_weight_decay", default))

    def learning_rates(self) -> list[torch.Tensor]:
        """Each group's current learning rate as a 0-dim tensor (a graph input)."""
        groups = self.optimizer.param_groups
        return [torch.tensor(float(g["lr"]), dtype=torch.float32) for g in groups]

    def update(self, grads: Sequence[Sequence[torch.Tensor]], lrs: Sequence[torch.Tensor]) -> None:
        """Apply one step: ``grads[i]`` are group i's parameters' gradients, in order."""
        with torch.no_grad():
            groups = self.optimizer.param_groups
            for group, group_grads, lr in zip(groups, grads, lrs, strict=True):
                params = list(group["params"])
                states = [self.optimizer.state[p] for p in params]
                if self.adam:
                    beta1, beta2 = group["betas"]
                    adam_update(
                        params,
                        list(group_grads),
                        [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states],
                        [],
                        [s["step"] for s in states],
                        foreach=False,
                        decoupled_weight_decay=self._decoupled(group),
                        amsgrad=False,
                        beta1=beta1,
                        beta2=beta2,
                        lr=lr,
                        weight_decay=group["weight_decay"],
                        eps=group["eps"],
                        maximize=False,
                    )
                else:
                    buffers = [s.get("momentum_buffer") for s in states]
                    sgd_update(
                        params,
                        list(group_grads),
                        buffers,
                        foreach=False,
                        weight_decay=group["weight_decay"],
                        momentum=group["momentum"],
                        lr=lr,  # type: ignore[arg-type]  # a 0-dim tensor: no recompile
                        dampening=group["dampening"],
                        nesterov=False,
                        maximize=False,
                    )
