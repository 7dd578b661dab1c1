"""A unit's configuration, as the strategy hands it to the engine.

What the unit is made of (its layout, this rank's shard buffer and the parameters that
are views of it, where the model holds them), how its collectives run (groups,
primitives, the host hierarchy, the gradient codec, the replicas), the plan's node ids
and flags for it, and who hears its collectives (:class:`GatherObserver`, the run log).
The gather path (:mod:`lamina.memory.unit_gather`) and the gradient path
(:mod:`lamina.memory.unit_reduce`) read it; neither changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lamina.dtypes import dtype_name
from lamina.memory.compressed import GradientCodec
from lamina.memory.gather import Primitive
from lamina.memory.hierarchy import HostHierarchy
from lamina.memory.layout import UnitLayout


class GatherObserver(Protocol):
    """Hears every collective a unit issues, by execution-plan node id (the run log)."""

    def collective(
        self, node_id: str, nbytes: int | None = None, wire: dict[str, int] | None = None
    ) -> AbstractContextManager[Any]:
        """Wraps issuing plan node ``node_id``'s collective (``nbytes`` as its op counts
        it; ``wire``: bytes per dtype handed to ``torch.distributed`` over all its
        calls); the handle takes ``.work``."""

    def begin_step(self) -> None:
        """A training step began (one gather for all of a step's microbatches): what the
        step issues counts as one step."""

    def begin_backward(self) -> None:
        """Backward started."""

    def end_backward(self) -> None:
        """Backward's computation ended."""

    def fallback(self, node_id: str, alternative: str, reason: str) -> object:
        """Plan node ``node_id`` switched to ``alternative`` at run time."""


#: Makes a parameter's gradient from a local tensor (the wrapper builds the DTensor).
GradMaker = Callable[[nn.Parameter, torch.Tensor], torch.Tensor]


@dataclass
class UnitConfig:
    """One unit on this rank, as the strategy configures it. Nothing here changes while
    the unit runs; only a device move of the model (``to()``, ``to_empty()``) replaces
    ``shard``, and the parameters with views of the new one."""

    layout: UnitLayout
    #: This rank's shard buffer (the parameters' local shards are views of it).
    shard: torch.Tensor
    #: The model's (sharded) parameters of the unit, by name.
    params: dict[str, nn.Parameter]
    #: (module, attribute) places where each parameter lives, by parameter name.
    places: dict[str, list[tuple[nn.Module, str]]]
    rank: int
    primitive: Primitive
    group: dist.ProcessGroup | None
    #: Turns a local gradient into the parameter's ``.grad`` (a DTensor like the param).
    make_grad: GradMaker
    #: Dtype of the gathered parameters (mixed precision); None: the shard's dtype.
    compute_dtype: torch.dtype | None = None
    #: Primitive of the gradient reduce-scatter (None: ``primitive``).
    scatter_primitive: Primitive | None = None
    #: Plan node ids: ``{"fwd", "bwd", "scatter", "replicate"}`` and who hears them.
    nodes: dict[str, str] = field(default_factory=dict)
    observer: GatherObserver | None = None
    #: Group of the replicas of this shard (HSDP's slow axis; None: no replicas), and
    #: their number: the shard gradient is averaged across them after the reduce-scatter.
    replicate_group: dist.ProcessGroup | None = None
    replicas: int = 1
    #: The hosts' two-phase gather and reduce-scatter, when the plan chose the
    #: hierarchical algorithm for this unit (None: ``primitive`` on ``group``).
    hierarchy: HostHierarchy | None = None
    #: Kept gathered from its forward to its backward even when the engine reshards
    #: after forward (the plan has no backward gather for it).
    keep_for_backward: bool = False
    #: Names of the unit's frozen parameters (``requires_grad=False``): gathered for the
    #: forward, never given a gradient.
    frozen: frozenset[str] = frozenset()
    #: Whether the plan gathers the unit again for backward (False for a unit it keeps
    #: gathered from its forward to its backward, and without resharding).
    planned_bwd_gather: bool = True
    #: The compressed reduction of the gradient's ``codec_role`` collective ("scatter"
    #: or "replicate", :mod:`lamina.memory.compressed`), when the plan gives one.
    codec: GradientCodec | None = None
    codec_role: str = "scatter"

    @property
    def all_frozen(self) -> bool:
        """Every parameter of the unit is frozen: it never has a gradient to reduce."""
        return len(self.frozen) == len(self.layout.params)

    def traced(
        self, role: str, nbytes: int | None = None, wire: dict[str, int] | None = None
    ) -> AbstractContextManager[Any]:
        """Context around issuing this unit's ``role`` collective ("fwd", "bwd",
        "scatter", "replicate"): ``nbytes`` as its op counts them and ``wire`` what its
        calls hand to ``torch.distributed`` (defaults: the plan's, one call)."""
        peers = self.replicas if role == "replicate" else self.layout.world_size
        if self.observer is None or peers == 1:
            return nullcontext(None)
        node = self.nodes.get(role, f"{self.layout.name}.{role}")
        return self.observer.collective(node, nbytes, wire)

    def phased(self, buffer_numel: int, dtype: torch.dtype) -> dict[str, int]:
        """What a hierarchical gather or reduce-scatter of a ``buffer_numel`` buffer
        hands to ``torch.distributed``: the whole buffer inside the host, and its ``1/L``
        part across the hosts (``L`` ranks per host); without a hierarchy, one call of
        the buffer."""
        size = buffer_numel * dtype.itemsize
        if self.hierarchy is not None:
            size += size // len(self.hierarchy.intra_ranks)
        return {dtype_name(dtype): size}
