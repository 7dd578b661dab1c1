"""Data parallelism planned from the static graph: ``lamina.distribute(model, "dp")``.

One folder, one strategy: :mod:`.options` (what it accepts), :mod:`.plan` (its execution
plan from the captured graph and bucket plan), :mod:`.planner` (the state a model gains:
planning at the first forward, the reducer), :mod:`.wrapper` (the model's class extended
in place), :mod:`.compiled` (the compiled forward and its fallback to eager).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.strategies.contract import Placement, Strategy, StrategyOptions
from lamina.strategies.dp.options import DataParallelOptions
from lamina.strategies.dp.planner import DataParallelState
from lamina.strategies.dp.wrapper import DataParallelModule, replicate_module

if TYPE_CHECKING:
    from lamina.session import Runtime


class DataParallelStrategy(Strategy):
    """Replicates the model over every axis it is placed on; averages gradients there."""

    name = "dp"
    summary = "data parallel: bucketed gradient all-reduces planned from the captured graph"
    options = DataParallelOptions

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """Replicate over every mesh axis (the whole job)."""
        return Placement(replicate=mesh.axis_names)

    def wrap(
        self, model: nn.Module, runtime: Runtime, placement: Placement, options: StrategyOptions
    ) -> nn.Module:
        """``model`` itself, extended by :class:`DataParallelModule` over the group
        ``placement`` replicates over."""
        if placement.shard:
            raise ConfigError(
                f"strategy 'dp' does not shard, but placement shards over {list(placement.shard)}; "
                "replicate over every mesh axis, or use 'zero3' or 'hsdp'"
            )
        assert isinstance(options, DataParallelOptions)
        return replicate_module(model, runtime, placement, options)


__all__ = [
    "DataParallelModule",
    "DataParallelOptions",
    "DataParallelState",
    "DataParallelStrategy",
    "replicate_module",
]
