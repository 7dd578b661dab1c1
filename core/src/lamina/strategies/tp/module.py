"""The methods a tensor-parallel model gains (its class is extended, not wrapped)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.split_state import SplitStateModule
from lamina.strategies.tp.activation_ops import StepLog, TensorGroup
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
    #: What the step issued, in order (None: built without one).
    step_log: StepLog | None = None


class TensorParallelModule(SplitStateModule):
    """A model split by ``tp``: parameters are this rank's slices under their own names."""

    lamina_tp: TensorParallelism

    @property
    def split_views(self) -> GlobalViews:
        """Its split parameters' whole-tensor views."""
        return self.lamina_tp.views

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
