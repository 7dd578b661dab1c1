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

from lamina.device.mesh import TOPOLOGY_AXES, DeviceMesh
from lamina.strategies.contract import Placement, axis_names
from lamina.strategies.zero3 import Zero3Strategy

#: The axes HSDP replicates over and shards over by default (``inter``, ``intra``).
REPLICATE_AXIS, SHARD_AXIS = TOPOLOGY_AXES


class HybridShardedStrategy(Zero3Strategy):
    """Shards over the fast axis, replicates over the slow one (see the module): ZeRO-3's
    plan and build on another default placement."""

    name = "hsdp"
    summary = "HSDP: ZeRO-3 inside each fast domain (intra), replicated across domains (inter)"

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """Shard over ``intra``, replicate over ``inter`` (ConfigError without them)."""
        axis_names(mesh, (REPLICATE_AXIS, SHARD_AXIS), self.name)
        return Placement(shard=(SHARD_AXIS,), replicate=(REPLICATE_AXIS,))


__all__ = ["HybridShardedStrategy"]
