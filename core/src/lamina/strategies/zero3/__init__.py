"""ZeRO-3: ``lamina.distribute(model, "zero3")``, and the engine HSDP places on two axes.

One folder, one strategy: :mod:`.options` (what it accepts), :mod:`.plan` (its execution
plan from the shard layout), :mod:`.sharding` (the model sharded in place over the memory
layer's engine: its parameters become DTensors, so torch's state-dict and checkpoint
APIs work as with FSDP2; its steps in :mod:`.groups`, :mod:`.planning`,
:mod:`.engine_settings` and :mod:`.engine_build`), :mod:`.module` (the methods the
sharded model gains), :mod:`.accounting` (memory against the ZeRO-3 formula).
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
from lamina.strategies.zero3.module import ShardedModule
from lamina.strategies.zero3.options import Zero3Options
from lamina.strategies.zero3.sharding import build_sharded, plan_shards

if TYPE_CHECKING:
    from lamina.strategies.compiled.in_graph import InGraphCollectives
    from lamina.strategies.compiled.step import CompiledStep, LossFn, StepJob, StepOptions

#: Where a model ``zero3`` / ``hsdp`` distributes records its own class (the model's
#: ``__dict__``): the class ``build`` extends, whose forward the compiled step traces.
MODEL_CLASS = "lamina_model_class"


class Zero3Strategy(Strategy):
    """Shards parameters, gradients and optimizer state over the axes it is placed on;
    replicates (gradients all-reduced) over the others."""

    name = "zero3"
    role = "shard"
    holds_after = frozenset({"split", "pipeline"})
    summary = "ZeRO-3: parameters, gradients and optimizer state sharded across ranks"
    options = Zero3Options

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """Shard over every mesh axis (the whole job)."""
        return Placement(shard=mesh.axis_names)

    def plan(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        inputs: StepInputs | None = None,
    ) -> PlannedStep:
        """The sharded step over ``placement``'s shard (and replica) groups."""
        assert isinstance(options, Zero3Options)
        return plan_shards(model, ctx, placement, options, self.name)

    def build(self, planned: PlannedStep) -> nn.Module:
        """The model itself, sharded in place as the plan says."""
        return build_sharded(planned)

    def prepare(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        plan_and_build: PlanAndBuild,
    ) -> nn.Module:
        """``model`` unchanged, its own class recorded (:data:`MODEL_CLASS`) before
        ``build`` extends it."""
        model.__dict__[MODEL_CLASS] = type(model)
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
        """The sharded step as one graph: the units' gathers, the forward of the model's
        own class (with ``inside``'s collectives: tp's), the backward, the reduce-scatters
        (and HSDP's replica all-reduces), the update of the local shards
        (:class:`~lamina.strategies.zero3.compiled_step.ShardedCompiledStep`)."""
        from lamina.strategies.zero3.compiled_step import ShardedCompiledStep

        own = model.__dict__.get(MODEL_CLASS)
        if not isinstance(model, ShardedModule) or not isinstance(own, type):
            raise ConfigError(
                f"compile_step: this {type(model).__name__} was not sharded by {self.name!r}; "
                f"call lamina.distribute(model, {self.name!r}) and pass the model it returns"
            )
        return ShardedCompiledStep(
            model, optimizer, loss_fn, settings, job, model_class=own, inside=inside
        )


__all__ = ["ShardedModule", "Zero3Options", "Zero3Strategy", "build_sharded", "plan_shards"]
