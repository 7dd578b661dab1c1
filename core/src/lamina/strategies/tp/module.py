"""The methods a tensor-parallel model gains (its class is extended, not wrapped)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.tp.activation_ops import TensorGroup
from lamina.strategies.tp.layers import TensorPlan
from lamina.verify import PreflightReport


@dataclass
class TensorParallelism:
    """What a tensor-parallel model carries: its layer plan, group and step plan."""

    plan: TensorPlan
    group: TensorGroup
    execution_plan: ExecutionPlan
    run_log: RunLog
    preflight: PreflightReport | None


class TensorParallelModule(nn.Module):
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
