"""HSDP: ``lamina.distribute(model, "hsdp")``: ZeRO-3 inside a fast domain, replicas across.

Parameters, gradients and optimizer state are sharded over the mesh's ``intra`` axis
(one host, one NVLink island: the ranks joined by fast links) and replicated over its
``inter`` axis (the slow links between domains). Per unit and step: parameters are
all-gathered inside the domain only; the gradient is reduce-scattered inside the domain,
then only the shard (1/intra of it) is all-reduced across domains. It is the ZeRO-3
engine with another placement (the placement is data, not another engine), so this
folder holds only the strategy's declaration.

The mesh comes from the topology (``lamina.init(mesh="topology")``: ``inter`` x
``intra`` from fast domains) or from an explicit ``lamina.init(mesh=(shape, axes))``;
``placement=Placement(shard=(...), replicate=(...))`` names other axes.
"""

from __future__ import annotations

from torch import nn

from lamina.device.mesh import TOPOLOGY_AXES, DeviceMesh
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import (
    Placement,
    PlannedStep,
    StepInputs,
    Strategy,
    StrategyOptions,
    axis_names,
)
from lamina.strategies.zero3.options import Zero3Options
from lamina.strategies.zero3.sharding import build_sharded, plan_shards

#: The axes HSDP replicates over and shards over by default (``inter``, ``intra``).
REPLICATE_AXIS, SHARD_AXIS = TOPOLOGY_AXES


class HybridShardedStrategy(Strategy):
    """Shards over the fast axis, replicates over the slow one (see the module)."""

    name = "hsdp"
    summary = "HSDP: ZeRO-3 inside each fast domain (intra), replicated across domains (inter)"
    options = Zero3Options

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """Shard over ``intra``, replicate over ``inter`` (ConfigError without them)."""
        axis_names(mesh, (REPLICATE_AXIS, SHARD_AXIS), self.name)
        return Placement(shard=(SHARD_AXIS,), replicate=(REPLICATE_AXIS,))

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


__all__ = ["HybridShardedStrategy"]
