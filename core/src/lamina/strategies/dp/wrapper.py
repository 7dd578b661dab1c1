"""Data parallelism planned from the static graph (``lamina.distribute(model, "dp")``).

:func:`replicate_module` returns the same model, its class extended by
:class:`DataParallelModule` (as ``zero3`` extends it), so ``isinstance``, the model's own
methods (``generate``, ``save_pretrained``, ``gradient_checkpointing_enable``) and its
``state_dict()`` keys stay the model's; the data-parallel state
(:class:`~lamina.strategies.dp.planner.DataParallelState`) is plain state in
``model.__dict__["lamina_dp"]``, not a submodule or buffer.

Planning never gets in the way: nothing is planned and no collective runs before the
first forward that records gradients (gradients enabled), wherever it happens, inside
``no_sync()`` included; ``no_sync()``, ``state_dict()``, ``load_state_dict()``, ``to()``,
``to_empty()``, ``train()``/``eval()`` and the model's own methods work before it. A
forward without gradients (under ``torch.no_grad()``, ``inference_mode()``, or
``generate()``, which runs under ``no_grad``) never issues a collective: before the plan
exists it runs the model's own forward unplanned, afterwards the planned one, and it
records no training step. So one rank may evaluate or generate alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.buckets import BucketPlan
from lamina.comm.reducer import GradientReducer
from lamina.graph import CapturedGraph
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import Placement, PlanAndBuild, StepInputs
from lamina.strategies.dp.options import DataParallelOptions
from lamina.strategies.dp.planner import DataParallelState
from lamina.strategies.extension import extend_class
from lamina.strategies.surface import DistributedModule
from lamina.verify import PreflightReport


class DataParallelModule(DistributedModule):
    """The methods a model distributed with ``dp`` gains (its class is extended, not
    wrapped). Parameters and buffers are broadcast from the group's first rank when the
    plan is built, and buffers again before every training forward (as torch DDP does),
    so every rank holds the same model. ``model.parameters()`` go to a stock optimizer.
    Each optional path has a declared fallback in :attr:`execution_plan`;
    :meth:`step_summary` shows those taken.

    Besides these, the extended class has the read-only aliases ``module`` (the model
    itself, for DDP-style ``model.module.save_pretrained(...)``), ``plan`` (the bucket
    plan), ``graph`` (the captured graph), ``reducer`` and ``algorithm_groups``, each
    unless the model already has an attribute of that name.
    """

    lamina_dp: DataParallelState

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; the first one with gradients enabled plans the step."""
        state = self.lamina_dp
        own = super().forward
        if state.plan is None:
            if not torch.is_grad_enabled():  # nothing to average: run it unplanned
                return own(*args, **kwargs)
            state.plan_and_build(StepInputs(args, kwargs))  # lamina.distribute's sequence
        return state.run_forward(self, own, args, kwargs)

    @property
    def execution_plan(self) -> ExecutionPlan | None:
        """The plan of one step (None until planned)."""
        return self.lamina_dp.execution_plan

    @property
    def run_log(self) -> RunLog | None:
        """What each step issued and which run-time fallbacks it took (None until planned)."""
        return self.lamina_dp.run_log

    @property
    def preflight(self) -> PreflightReport | None:
        """The pre-flight verification report (None until planned, or when turned off)."""
        return self.lamina_dp.preflight

    def step_summary(self) -> str:
        """One line: collectives of the last step and every fallback taken."""
        return self.lamina_dp.step_summary()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the next one outside synchronizes.
        Works before the first forward too (the plan built inside keeps sync off)."""
        state = self.lamina_dp
        previous = state.sync_enabled
        state.set_sync(False)
        try:
            yield
        finally:
            state.set_sync(previous)


def _the_model(self: nn.Module) -> nn.Module:
    """The model itself (``model.module``, as under DDP)."""
    return self


def _bucket_plan(self: DataParallelModule) -> BucketPlan | None:
    """The bucket plan (None until planned)."""
    return self.lamina_dp.plan


def _captured_graph(self: DataParallelModule) -> CapturedGraph | None:
    """The captured forward graph (None until planned)."""
    return self.lamina_dp.graph


def _gradient_reducer(self: DataParallelModule) -> GradientReducer | None:
    """The gradient reducer (None until planned)."""
    return self.lamina_dp.reducer


def _groups(self: DataParallelModule) -> AlgorithmGroups | None:
    """The process groups of the buckets' all-reduce algorithms (None: every bucket flat)."""
    return self.lamina_dp.algorithm_groups


#: Aliases the extended class gets where the model has no attribute of that name.
ALIASES = {
    "module": property(_the_model),
    "plan": property(_bucket_plan),
    "graph": property(_captured_graph),
    "reducer": property(_gradient_reducer),
    "algorithm_groups": property(_groups),
}


def replicate_module(
    module: nn.Module,
    ctx: StrategyContext,
    placement: Placement,
    options: DataParallelOptions,
    plan_and_build: PlanAndBuild,
) -> DataParallelModule:
    """Extend ``module`` in place for data parallelism over the group ``placement``
    replicates over and return it, unplanned (see the module docstring); its first
    forward with gradients calls ``plan_and_build``."""
    cls = type(module)
    state = DataParallelState(ctx, placement, options, cls, plan_and_build)
    aliases = {name: alias for name, alias in ALIASES.items() if not hasattr(module, name)}
    return extend_class(module, DataParallelModule, aliases, "lamina_dp", state)
