"""Data parallelism planned from the static graph: ``lamina.distribute(model, "dp")``.

One folder, one strategy: :mod:`.options` (what it accepts), :mod:`.plan` (its execution
plan from the captured graph and bucket plan), :mod:`.planner` (the state a model gains:
planning at the first forward, the reducer), :mod:`.wrapper` (the model's class extended
in place), :mod:`.compiled` (the compiled forward and its fallback to eager).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import (
    Placement,
    PlanAndBuild,
    PlannedStep,
    StepInputs,
    Strategy,
    StrategyOptions,
)
from lamina.strategies.dp.options import DataParallelOptions
from lamina.strategies.dp.planner import DataParallelState
from lamina.strategies.dp.wrapper import DataParallelModule, replicate_module

if TYPE_CHECKING:
    from lamina.strategies.compiled.in_graph import InGraphCollectives
    from lamina.strategies.compiled.step import CompiledStep, LossFn, StepJob, StepOptions


class DataParallelStrategy(Strategy):
    """Replicates the model over every axis it is placed on; averages gradients there.
    The step is planned from the graph captured at the first forward that records
    gradients (or from ``example_inputs``, at once)."""

    name = "dp"
    summary = "data parallel: bucketed gradient all-reduces planned from the captured graph"
    options = DataParallelOptions

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """Replicate over every mesh axis (the whole job)."""
        return Placement(replicate=mesh.axis_names)

    def plans_at_first_forward(self, options: StrategyOptions) -> bool:
        """Yes, unless ``example_inputs`` / ``example_kwargs`` were given."""
        assert isinstance(options, DataParallelOptions)
        return options.example_inputs is None and options.example_kwargs is None

    def prepare(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        plan_and_build: PlanAndBuild,
    ) -> nn.Module:
        """``model`` itself, extended by :class:`DataParallelModule` over the group
        ``placement`` replicates over; it plans at its first forward with gradients."""
        if placement.shard:
            raise ConfigError(
                f"strategy 'dp' does not shard, but placement shards over {list(placement.shard)}; "
                "replicate over every mesh axis, or use 'zero3' or 'hsdp'"
            )
        assert isinstance(options, DataParallelOptions)
        return replicate_module(model, ctx, placement, options, plan_and_build)

    def plan(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        inputs: StepInputs | None = None,
    ) -> PlannedStep:
        """The bucketed step from the graph captured on ``inputs`` (else the options'
        example inputs)."""
        assert isinstance(model, DataParallelModule) and isinstance(options, DataParallelOptions)
        if inputs is None:
            inputs = StepInputs(options.example_inputs or (), options.example_kwargs or {})
        return model.lamina_dp.plan_step(model, inputs)

    def build(self, planned: PlannedStep) -> nn.Module:
        """The model with its reducer installed, as the plan says."""
        model = planned.module
        assert isinstance(model, DataParallelModule)
        model.lamina_dp.install(model, planned)
        return model

    def compiled_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        settings: StepOptions,
        job: StepJob,
        inside: Sequence[InGraphCollectives] = (),
    ) -> CompiledStep:
        """The data-parallel step as one graph: the forward of the model's own class, the
        backward, the plan's bucket all-reduces, the update
        (:class:`~lamina.strategies.dp.compiled_step.DataParallelCompiledStep`); ``dp``
        composes with no split, so ``inside`` is empty."""
        from lamina.strategies.dp.compiled_step import DataParallelCompiledStep

        if inside:
            raise ConfigError(
                f"compile_step: 'dp' does not compile a step with {inside[0].name!r}'s "
                "collectives inside; compose it with 'zero3' or 'hsdp'"
            )

        if not isinstance(model, DataParallelModule):
            raise ConfigError(
                f"compile_step: this {type(model).__name__} was not extended by 'dp'; call "
                "lamina.distribute(model, 'dp') and pass the model it returns"
            )
        return DataParallelCompiledStep(model, model.lamina_dp, optimizer, loss_fn, settings, job)


__all__ = [
    "DataParallelModule",
    "DataParallelOptions",
    "DataParallelState",
    "DataParallelStrategy",
    "replicate_module",
]
