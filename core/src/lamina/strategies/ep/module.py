"""The methods an expert-parallel model gains (its class is extended, not wrapped)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.ep.aux_loss import BalanceGroup, balancing_over
from lamina.strategies.ep.find import MoeLayer
from lamina.strategies.ep.grad_sync import ExpertGradientSync
from lamina.strategies.ep.layer import DispatchedExperts
from lamina.strategies.split_state import SplitStateModule
from lamina.strategies.surface import PIPELINE_KEY
from lamina.strategies.tp.activation_ops import StepLog
from lamina.strategies.tp.state import GlobalViews
from lamina.verify import PreflightReport


@dataclass
class ExpertParallelism:
    """What an expert-parallel model carries: its MoE layers, their experts modules, the
    step's plan and log, the gradient sync and the load-balancing loss's group."""

    layers: tuple[MoeLayer, ...]
    experts: tuple[DispatchedExperts, ...]
    dispatcher: str
    ep: int
    execution_plan: ExecutionPlan
    run_log: RunLog
    log: StepLog
    preflight: PreflightReport | None
    views: GlobalViews
    sync: ExpertGradientSync
    balance: BalanceGroup | None

    def load_lines(self) -> tuple[str, ...]:
        """Each layer's assignments this rank routed per expert in the last forward, and
        their imbalance (the busiest expert over the mean)."""
        lines = []
        for index, module in enumerate(self.experts):
            routed = module.routed.tolist()
            mean = sum(routed) / max(len(routed), 1)
            imbalance = max(routed) / mean if mean else 0.0
            lines.append(
                f"MoE layer {index} load (this rank's assignments per expert): {routed}, "
                f"busiest/mean {imbalance:.2f}"
            )
        return tuple(lines)


class ExpertParallelModule(SplitStateModule):
    """A model whose MoE layers' experts lie across the ep axis: parameters are this
    rank's experts under their own names; ``state_dict()`` gives whole tensors."""

    lamina_ep: ExpertParallelism

    @property
    def split_views(self) -> GlobalViews:
        """The expert weights' whole-tensor views."""
        return self.lamina_ep.views

    @property
    def execution_plan(self) -> ExecutionPlan:
        """The step's plan (its expert-parallel collectives)."""
        return self.lamina_ep.execution_plan

    @property
    def run_log(self) -> RunLog:
        """What the step issued."""
        return self.lamina_ep.run_log

    def composed_summary(self) -> str:
        """:meth:`step_summary`, as a composed model shows it before its sharder's."""
        return ExpertParallelModule.step_summary(self)

    def step_summary(self) -> str:
        """The MoE layers, the dispatcher and the last forward's expert load."""
        state = self.lamina_ep
        lines = [
            f"expert parallelism over ep={state.ep}, dispatcher {state.dispatcher!r}, "
            f"load-balancing loss {'global' if state.balance else 'as the model computes it'}",
            *(layer.describe() for layer in state.layers),
            *state.load_lines(),
        ]
        return "\n".join(lines)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; a training forward opens the log's next step."""
        state = self.lamina_ep
        if torch.is_grad_enabled() and PIPELINE_KEY not in self.__dict__:
            # a step per forward; under a pipeline its engine runs the stages, and the
            # log keeps counting over the steps
            state.log.begin_step()
        with balancing_over(state.balance):
            return super().forward(*args, **kwargs)


__all__ = ["ExpertParallelModule", "ExpertParallelism"]
