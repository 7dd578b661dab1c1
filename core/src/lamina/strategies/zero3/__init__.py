"""ZeRO-3: ``lamina.distribute(model, "zero3")``, and the engine HSDP places on two axes.

One folder, one strategy: :mod:`.options` (what it accepts), :mod:`.plan` (its execution
plan from the shard layout), :mod:`.sharding` (the model sharded in place over the memory
layer's engine: its parameters become DTensors, so torch's state-dict and checkpoint
APIs work as with FSDP2; its steps in :mod:`.groups`, :mod:`.planning`,
:mod:`.engine_settings` and :mod:`.engine_build`), :mod:`.module` (the methods the
sharded model gains), :mod:`.accounting` (memory against the ZeRO-3 formula).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lamina.device.mesh import DeviceMesh
from lamina.strategies.contract import Placement, Strategy, StrategyOptions
from lamina.strategies.zero3.module import ShardedModule
from lamina.strategies.zero3.options import Zero3Options
from lamina.strategies.zero3.sharding import shard_module

if TYPE_CHECKING:
    from lamina.session import Runtime


class Zero3Strategy(Strategy):
    """Shards parameters, gradients and optimizer state over the axes it is placed on;
    replicates (gradients all-reduced) over the others."""

    name = "zero3"
    summary = "ZeRO-3: parameters, gradients and optimizer state sharded across ranks"
    options = Zero3Options

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """Shard over every mesh axis (the whole job)."""
        return Placement(shard=mesh.axis_names)

    def wrap(
        self, model: nn.Module, runtime: Runtime, placement: Placement, options: StrategyOptions
    ) -> nn.Module:
        """``model`` itself, sharded over ``placement.shard`` (see :func:`shard_module`)."""
        assert isinstance(options, Zero3Options)
        return shard_module(model, runtime, placement, options, strategy=self.name)


__all__ = ["ShardedModule", "Zero3Options", "Zero3Strategy", "shard_module"]
