"""The ZeRO-3 engine: sharded flat parameters gathered per unit just in time.

Each unit (a transformer block, the remaining root parameters) owns one flat shard per
rank: an ``nn.Parameter`` that the optimizer sees. Before a unit's forward its shards
are gathered into a full flat buffer (the next unit's gather is started asynchronously
right after), the module attributes become views of that buffer, and after the forward
the buffer is dropped. Autograd keeps no reference to it: a saved-tensor hook replaces
every saved view of a unit buffer by a token, and when backward needs it the unit is
gathered again (prefetching the unit before it). The gather's backward reduce-scatters
the full gradient straight into the shard's gradient and drops the buffer again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lamina.memory.gather import Primitive, gather_full, reduce_scatter_mean
from lamina.memory.layout import UnitLayout


class GatherObserver(Protocol):
    """Hears every collective a unit issues, by execution-plan node id (the run log)."""

    def collective(self, node_id: str, nbytes: int | None = None) -> AbstractContextManager[Any]:
        """Wraps issuing plan node ``node_id``'s collective; the handle takes ``.work``."""

    def begin_backward(self) -> None:
        """Backward started."""

    def end_backward(self) -> None:
        """Backward's computation ended."""


@dataclass
class UnitState:
    """Run-time state of one unit on this rank."""

    layout: UnitLayout
    shard: nn.Parameter
    #: (module, attribute) places where each parameter lives, by parameter name.
    places: dict[str, list[tuple[nn.Module, str]]]
    rank: int
    primitive: Primitive
    group: dist.ProcessGroup | None
    #: Dtype of the gathered parameters (mixed precision); None: the shard's dtype.
    compute_dtype: torch.dtype | None = None
    #: Primitive of the gradient reduce-scatter (None: ``primitive``).
    scatter_primitive: Primitive | None = None
    #: Plan node ids: ``{"fwd": ..., "bwd": ..., "scatter": ...}`` and who hears them.
    nodes: dict[str, str] = field(default_factory=dict)
    observer: GatherObserver | None = None
    #: Group of the replicas of this shard (HSDP's slow axis; None: no replicas), and
    #: their number: the shard gradient is averaged across them after the reduce-scatter.
    replicate_group: dist.ProcessGroup | None = None
    replicas: int = 1
    full: torch.Tensor | None = None
    pending: Any = None
    gathers: int = field(default=0)

    def traced(self, role: str) -> AbstractContextManager[Any]:
        """Context around issuing this unit's ``role`` collective ("fwd", "bwd",
        "scatter", "replicate")."""
        peers = self.replicas if role == "replicate" else self.layout.world_size
        if self.observer is None or peers == 1:
            return nullcontext(None)
        return self.observer.collective(self.nodes.get(role, f"{self.layout.name}.{role}"))

    def start_gather(self, phase: str = "fwd") -> None:
        """Begin gathering the full buffer (asynchronously where the backend allows);
        ``phase`` ("fwd"/"bwd") names the plan node it serves."""
        if self.full is not None or self.pending is not None:
            return
        dtype = self.compute_dtype or self.shard.dtype
        buffer = torch.empty(self.layout.total_numel, dtype=dtype, device=self.shard.device)
        with torch.no_grad():
            source = self.shard.detach().to(dtype)  # mixed precision: gather fewer bytes
            with self.traced(phase) as handle:
                work = gather_full(
                    source, buffer, self.rank, self.primitive, self.group, async_op=True
                )
                if handle is not None:
                    handle.work = work
        self.pending = (buffer, work)
        self.gathers += 1

    def wait_gather(self, phase: str = "fwd") -> torch.Tensor:
        """The full buffer, gathering now if no gather is in flight."""
        if self.full is None:
            self.start_gather(phase)
            buffer, work = self.pending
            if work is not None:
                work.wait()
            self.full, self.pending = buffer, None
        return self.full

    def gather_master(self) -> torch.Tensor:
        """The full buffer in the shard's own dtype (fp32 master weights under mixed
        precision), gathered now, apart from the buffer forward and backward use."""
        buffer = torch.empty(
            self.layout.total_numel, dtype=self.shard.dtype, device=self.shard.device
        )
        with torch.no_grad():
            gather_full(self.shard.detach(), buffer, self.rank, self.primitive, self.group)
        return buffer

    def views(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters as views of the full buffer ``full`` (any dtype)."""
        return {p.name: full[p.offset : p.end].view(p.shape) for p in self.layout.params}

    def release(self) -> None:
        """Drop the full buffer and any gather still in flight (finished first, so that
        every rank completes the same collectives)."""
        if self.pending is not None:
            _buffer, work = self.pending
            if work is not None:
                work.wait()
            self.pending = None
        self.full = None


class _GatherUnit(torch.autograd.Function):
    """shard -> full buffer; backward: full gradient -> this rank's mean shard gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: UnitState) -> torch.Tensor:  # type: ignore[override]
        ctx.unit = unit
        full = unit.wait_gather()
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        unit: UnitState = ctx.unit
        world = unit.layout.world_size
        # reduce in the shard's dtype (fp32 master weights under mixed precision)
        grad_full = grad_full.to(unit.shard.dtype)
        primitive = unit.scatter_primitive or unit.primitive
        with unit.traced("scatter"):
            grad = reduce_scatter_mean(grad_full, unit.rank, world, primitive, unit.group)
        if unit.replicas > 1:  # HSDP: the same shard on every replica, averaged across them
            grad.div_(unit.replicas)
            with unit.traced("replicate"):
                dist.all_reduce(grad, group=unit.replicate_group)
        unit.release()
        return grad, None


class Zero3Engine:
    """Installs and removes gathered parameter views around each unit's forward."""

    def __init__(
        self, units: list[UnitState], root: nn.Module, reshard_after_forward: bool = True
    ) -> None:
        self.units = units
        self.root = root
        #: False keeps each unit's full buffer from its forward until its backward
        #: (less communication, more memory).
        self.reshard_after_forward = reshard_after_forward
        self._by_storage: dict[int, UnitState] = {}
        self._forward_order: list[UnitState] = []
        self._recording = True
        #: Told when a backward starts and ends (the run log, for tracing).
        self.observer: GatherObserver | None = None
        self._in_backward = False

    # -- forward ------------------------------------------------------------------------
    def enter_unit(self, unit: UnitState) -> None:
        """Gather ``unit``, prefetch the next one, install its parameter views."""
        if self._recording:
            self._forward_order.append(unit)
        full: torch.Tensor = _GatherUnit.apply(unit.shard, unit)  # type: ignore[no-untyped-call]
        self._by_storage[full.untyped_storage().data_ptr()] = unit
        nxt = self._next_after(unit)
        if nxt is not None:
            nxt.start_gather()
        views = unit.views(full)
        for name, view in views.items():
            for module, attr in unit.places[name]:
                setattr(module, attr, view)

    def leave_unit(self, unit: UnitState) -> None:
        """Drop the views and (when resharding after forward) the buffer; autograd keeps
        tokens, not the buffer, and backward gathers the unit again."""
        for places in unit.places.values():
            for module, attr in places:
                setattr(module, attr, _EMPTY)
        if unit.full is not None:
            self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)
        if self.reshard_after_forward:
            unit.release()

    def drop_stale_prefetches(self) -> None:
        """Before a forward: no unit keeps a buffer gathered before the optimizer step."""
        for unit in self.units:
            unit.release()

    def finish_forward(self) -> None:
        """The first forward fixed the unit order used for prefetching."""
        self._recording = False

    def _next_after(self, unit: UnitState) -> UnitState | None:
        order = self._forward_order if not self._recording else self.units
        if unit not in order:
            return None
        k = order.index(unit)
        return order[k + 1] if k + 1 < len(order) else None

    def _previous_of(self, unit: UnitState) -> UnitState | None:
        order = self._forward_order or self.units
        if unit not in order:
            return None
        k = order.index(unit)
        return order[k - 1] if k > 0 else None

    # -- saved tensors --------------------------------------------------------------------
    @contextmanager
    def saved_views_as_tokens(self) -> Iterator[None]:
        """Within the block, autograd saves tokens instead of views of unit buffers."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> Any:
        unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return _Token(
            unit,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
            tensor.requires_grad,
        )

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Token):
            return packed  # type: ignore[no-any-return]
        if not self._in_backward and self.observer is not None:
            self._in_backward = True
            self.observer.begin_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        full = packed.unit.wait_gather("bwd")
        previous = self._previous_of(packed.unit)
        if previous is not None:
            previous.start_gather("bwd")  # backward runs the units in reverse
        view = full.as_strided(packed.shape, packed.stride, packed.offset)
        return view

    def _end_backward(self) -> None:
        self._in_backward = False
        if self.observer is not None:
            self.observer.end_backward()


@dataclass(frozen=True)
class _Token:
    unit: UnitState
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool


_EMPTY = torch.empty(0)
