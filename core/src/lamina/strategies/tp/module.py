"""The methods a tensor-parallel model gains (its class is extended, not wrapped)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.surface import DistributedModule
from lamina.strategies.tp.activation_ops import TensorGroup
from lamina.strategies.tp.layers import TensorPlan
from lamina.strategies.tp.loss_parallel import HeadOutputs
from lamina.strategies.tp.state import GlobalViews
from lamina.verify import PreflightReport


@dataclass
class TensorParallelism:
    """What a tensor-parallel model carries: its layer plan, group and step plan."""

    plan: TensorPlan
    group: TensorGroup
    execution_plan: ExecutionPlan
    run_log: RunLog
    preflight: PreflightReport | None
    views: GlobalViews
    heads: HeadOutputs
    #: Set while lamina itself runs the model on the meta device (a sharded strategy's
    #: first-forward bookkeeping does not run it).
    allow_meta: bool = False


class TensorParallelModule(DistributedModule):
    """A model split by ``tp``: parameters are this rank's slices under their own names."""

    lamina_tp: TensorParallelism

    @property
    def execution_plan(self) -> ExecutionPlan:
        """The step's plan (its tensor-parallel collectives)."""
        return self.lamina_tp.execution_plan

    @property
    def tensor_plan(self) -> TensorPlan:
        """Which layer is split how."""
        return self.lamina_tp.plan

    @property
    def run_log(self) -> RunLog:
        """What the step issued."""
        return self.lamina_tp.run_log

    def step_summary(self) -> str:
        """The plan's layers, one per line."""
        return "\n".join(self.lamina_tp.plan.lines())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; a one-line error while parameters are on the meta device."""
        if any(p.is_meta for p in self.parameters()) and not self.lamina_tp.allow_meta:
            raise ConfigError(
                "this tensor-parallel model's parameters are on the meta device; call "
                "model.to_empty(device=...) and initialize or load the weights before the "
                "first forward"
            )
        return super().forward(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """torch's ``state_dict``, each split parameter a ``DTensor`` of the whole tensor
        (:mod:`.state`; ``keep_vars=True``: the parameters themselves)."""
        state = super().state_dict(*args, **kwargs)
        if kwargs.get("keep_vars") or (len(args) > 2 and args[2]):
            return state
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        views = self.lamina_tp.views
        for key in list(state):
            state[key] = views.to_global(key[len(prefix) :], state[key])
        return state

    def optimizer_state_to_global(self, optim_state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state dict by parameter name (``get_state_dict``'s) with each
        split parameter's state tensors as whole-tensor DTensors, as its parameter is in
        ``state_dict()``: what a checkpoint saves (collective, as saving is)."""
        return _map_optimizer(optim_state, self.lamina_tp.views.to_global)

    def optimizer_state_to_local(self, optim_state: dict[str, Any]) -> dict[str, Any]:
        """:meth:`optimizer_state_to_global` undone: each state tensor in its parameter's
        own form (this rank's piece), for ``set_state_dict``."""
        targets = super().state_dict(keep_vars=True)
        views = self.lamina_tp.views

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
        views = self.lamina_tp.views
        state = {
            key: views.to_local(key, value, targets[key]) if key in targets else value
            for key, value in state_dict.items()
        }
        return super().load_state_dict(state, strict=strict, assign=assign)


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
