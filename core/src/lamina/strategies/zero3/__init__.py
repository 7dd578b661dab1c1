"""ZeRO-3: ``lamina.distribute(model, "zero3")``, and the engine HSDP places on two axes.

One folder, one strategy: :mod:`.options` (what it accepts), :mod:`.plan` (its execution
plan from the shard layout), :mod:`.sharding` (the model sharded in place over the memory
layer's engine: its parameters become DTensors, so torch's state-dict and checkpoint
APIs work as with FSDP2; its steps in :mod:`.groups`, :mod:`.planning`,
:mod:`.engine_settings` and :mod:`.engine_build`), :mod:`.module` (the methods the
sharded model gains), :mod:`.accounting` (memory against the ZeRO-3 formula).
"""

from __future__ import annotations

from torch import nn

from lamina.device.mesh import DeviceMesh
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import (
    Placement,
    PlannedStep,
    StepInputs,
    Strategy,
    StrategyOptions,
)
from lamina.strategies.zero3.module import ShardedModule
from lamina.strategies.zero3.options import Zero3Options
from lamina.strategies.zero3.sharding import build_sharded, plan_shards


class Zero3Strategy(Strategy):
    """Shards parameters, gradients and optimizer state over the axes it is placed on;
    replicates (gradients all-reduced) over the others."""

    name = "zero3"
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


__all__ = ["ShardedModule", "Zero3Options", "Zero3Strategy", "build_sharded", "plan_shards"]
