"""Plan nodes both strategies share: the broadcasts of rank 0's state."""

from __future__ import annotations

from collections.abc import Sequence

from lamina.dtypes import dtype_from_name
from lamina.runtime.nodes import Collective
from lamina.runtime.plan import CollectiveSpec, PlanNode


def setup_node(dtype: str) -> str:
    """Node id of the wrap-time broadcast of all ``dtype`` parameters and buffers."""
    return f"setup.broadcast.{dtype}"


def buffers_node(dtype: str) -> str:
    """Node id of the per-step broadcast of all ``dtype`` buffers."""
    return f"buffers.broadcast.{dtype}"


def broadcast_nodes(
    phase: str, state: Sequence[tuple[str, int]], group: tuple[int, ...], axis: str = "world"
) -> list[PlanNode]:
    """One coalesced broadcast from the group's first rank per (dtype, numel) of ``state``:
    ``phase="setup"`` at wrap time (parameters and buffers), ``"forward"`` before each
    training forward (buffers)."""
    setup = phase == "setup"
    what = "parameters and buffers" if setup else "buffers"
    return [
        PlanNode(
            setup_node(dtype) if setup else buffers_node(dtype),
            "collective",
            phase,
            f"broadcast {dtype} {what} from rank {group[0]}",
            Collective("broadcast", source=group[0]),
            CollectiveSpec(
                "broadcast", dtype, numel, dtype_from_name(dtype).itemsize, group, axis=axis
            ),
        )
        for dtype, numel in state
    ]
