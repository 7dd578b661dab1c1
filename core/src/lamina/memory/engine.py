"""The ZeRO-3 engine: units of row-sharded parameters, gathered just in time.

Each unit owns one flat shard buffer per rank (see :mod:`lamina.memory.layout`); the
model's parameters are views of it, so the optimizer updates it in place. Before a
unit's forward the shard buffers are gathered into the unsharded buffer (the next
unit's gather is started asynchronously right after) and the module's parameters are
replaced by views of it for the forward; afterwards the buffer is dropped and the module
holds its sharded parameters again. How the unsharded buffer is filled depends on the
primitive: ``all_gather_into_tensor`` (on gloo, one broadcast per rank) gives the
rank-major gathered buffer, copied out in one fused copy; the all-reduce form sums
buffers that already have the unsharded layout (each rank's rows in place, zeros
elsewhere), so nothing is copied out; a unit the plan gives the hierarchical algorithm
gathers and reduce-scatters in two phases, inside then across hosts
(:mod:`lamina.memory.hierarchy`); with one rank the shard buffer itself (or its cast
to the compute dtype) is the unsharded buffer.
Autograd keeps no reference to the buffer: a saved-tensor hook replaces every saved view
by a token, and when backward needs it the unit is gathered again (prefetching the unit
before it).

The gather is one autograd function with one output per parameter (the views), so its
backward receives each parameter's gradient, or None for a parameter autograd did not
reach. It lays them out rank-major in one fused copy, with one used-flag per parameter,
and starts the reduce-scatter asynchronously, on the communication stream where the
device has one; backward goes on with the units before it. When the next unit starts
its reduce-scatter (at the latest when backward ends) the earlier one is waited for,
averaged (and, with replicas, all-reduced across them), and each parameter some rank
used gets its shard of the gradient; a parameter no rank used keeps ``grad=None``, so
the optimizer leaves it exactly as it is. A unit called more than once in a forward
stays gathered until its last backward and sums its gradients into one reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from lamina.device.handle import DeviceHandle, Stream
from lamina.dtypes import dtype_name
from lamina.memory.compressed import GradientCodec, exact_all_reduce, usable
from lamina.memory.gather import (
    Primitive,
    gather_full,
    gather_unsharded,
    reduce_scatter_start,
)
from lamina.memory.hierarchy import HostHierarchy
from lamina.memory.layout import UnitLayout
from lamina.works import AllWorks


class GatherObserver(Protocol):
    """Hears every collective a unit issues, by execution-plan node id (the run log)."""

    def collective(
        self, node_id: str, nbytes: int | None = None, wire: dict[str, int] | None = None
    ) -> AbstractContextManager[Any]:
        """Wraps issuing plan node ``node_id``'s collective (``nbytes`` as its op counts
        it; ``wire``: bytes per dtype handed to ``torch.distributed`` over all its
        calls); the handle takes ``.work``."""

    def begin_backward(self) -> None:
        """Backward started."""

    def end_backward(self) -> None:
        """Backward's computation ended."""

    def fallback(self, node_id: str, alternative: str, reason: str) -> object:
        """Plan node ``node_id`` switched to ``alternative`` at run time."""


#: Makes a parameter's gradient from a local tensor (the wrapper builds the DTensor).
GradMaker = Callable[[nn.Parameter, torch.Tensor], torch.Tensor]


@dataclass
class UnitState:
    """Run-time state of one unit on this rank."""

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
    #: The unsharded buffer while the unit is gathered.
    full: torch.Tensor | None = None
    #: The gather in flight: (buffer, work, event, source, whether the buffer is laid
    #: out unsharded already).
    pending: Any = None
    gathers: int = 0
    #: The reduce-scatter in flight: (work, result getter, its input).
    scattering: Any = None
    #: Calls of the unit in this forward whose backward has not run yet: a unit called
    #: twice stays gathered, and sums its gradients, until the last of them.
    open_calls: int = 0
    #: Gradients (reduce-scatter input) summed over the backwards run so far, while
    #: ``open_calls`` is not zero.
    pending_grads: torch.Tensor | None = None
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
    #: or "replicate", :mod:`lamina.memory.compressed`), when the plan gives one, and
    #: the trace record its statistics go to.
    codec: GradientCodec | None = None
    codec_role: str = "scatter"
    codec_trace: Any = None

    @property
    def all_frozen(self) -> bool:
        """Every parameter of the unit is frozen: it never has a gradient to reduce."""
        return len(self.frozen) == len(self.layout.params)

    @property
    def anchor(self) -> torch.Tensor:
        """A leaf that requires grad, so the gather is part of the autograd graph."""
        anchor: torch.Tensor | None = getattr(self, "_anchor", None)
        if anchor is None or anchor.device != self.shard.device:
            anchor = torch.zeros(0, device=self.shard.device, requires_grad=True)
            object.__setattr__(self, "_anchor", anchor)
        return anchor

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

    def _phased(self, buffer_numel: int, dtype: torch.dtype) -> dict[str, int]:
        """What a hierarchical gather or reduce-scatter of a ``buffer_numel`` buffer
        hands to ``torch.distributed``: the whole buffer inside the host, and its ``1/L``
        part across the hosts (``L`` ranks per host); without a hierarchy, one call of
        the buffer."""
        size = buffer_numel * dtype.itemsize
        if self.hierarchy is not None:
            size += size // len(self.hierarchy.intra_ranks)
        return {dtype_name(dtype): size}

    def start_gather(self, phase: str = "fwd", streams: CommStreams | None = None) -> None:
        """Begin gathering the shard buffers (asynchronously where the backend allows);
        ``phase`` ("fwd"/"bwd") names the plan node it serves."""
        if self.full is not None or self.pending is not None:
            return
        dtype = self.compute_dtype or self.shard.dtype
        layout = self.layout
        with torch.no_grad():
            source = self.shard.detach().to(dtype)  # mixed precision: gather fewer bytes
            if layout.world_size == 1:  # the shard (or its cast) is the unsharded buffer
                unsharded = source.narrow(0, 0, layout.flag_offset)
                self.pending = (unsharded, None, None, source, True)
            else:
                # the all-reduce form sums buffers already laid out unsharded
                in_place = self.primitive == "all_reduce"
                buffer = torch.empty(layout.total_numel, dtype=dtype, device=source.device)
                _ready_for_comm(streams)  # the shards the optimizer wrote, on compute
                work: dist.Work | AllWorks | None
                wire = self._phased(layout.total_numel, dtype)
                with _on(streams), self.traced(phase, wire=wire) as handle:
                    if self.hierarchy is not None:
                        in_place = False
                        work = self.hierarchy.gather(source, buffer)
                    elif in_place:
                        work = gather_unsharded(source, buffer, layout, self.rank, self.group)
                    else:
                        work = gather_full(
                            source, buffer, self.rank, self.primitive, self.group, async_op=True
                        )
                    if handle is not None:
                        handle.work = work
                # ``source`` lives until the gather is waited for: on a device the comm
                # stream may still read it after this call returns
                self.pending = (buffer, work, _record(streams), source, in_place)
        self.gathers += 1

    def wait_gather(self, phase: str = "fwd", streams: CommStreams | None = None) -> torch.Tensor:
        """The unsharded buffer, gathering now if no gather is in flight."""
        if self.full is None:
            self.start_gather(phase, streams)
            buffer, work, event, _source, in_place = self.pending
            if work is not None:
                work.wait()
            _wait(streams, event)
            self.pending = None
            layout = self.layout
            if in_place:
                self.full = buffer.narrow(0, 0, layout.unsharded_numel)
            else:
                with torch.no_grad():
                    unsharded = torch.empty(
                        layout.unsharded_numel, dtype=buffer.dtype, device=buffer.device
                    )
                    self.full = layout.copy_out(buffer, unsharded)
        return self.full

    def gather_master(self) -> torch.Tensor:
        """The unsharded buffer in the shard's own dtype (fp32 master weights under mixed
        precision), gathered now, apart from the buffer forward and backward use."""
        layout = self.layout
        gathered = torch.empty(layout.total_numel, dtype=self.shard.dtype, device=self.shard.device)
        with torch.no_grad():
            gather_full(self.shard.detach(), gathered, self.rank, self.primitive, self.group)
            unsharded = torch.empty(
                layout.unsharded_numel, dtype=self.shard.dtype, device=self.shard.device
            )
            return layout.copy_out(gathered, unsharded)

    def release(self) -> None:
        """Drop the unsharded buffer and any gather still in flight (finished first, so
        that every rank completes the same collectives)."""
        if self.pending is not None:
            _buffer, work, _event, _source, _in_place = self.pending
            if work is not None:
                work.wait()
            self.pending = None
        self.full = None

    # -- gradients ------------------------------------------------------------------------
    def add_gradients(self, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """The reduce-scatter input of ``grads`` (in parameter order; None for a parameter
        autograd did not reach), in the shard's dtype, with one used-flag per parameter,
        summed with the gradients of the unit's earlier calls in this backward."""
        flags = torch.tensor(
            [g is not None for g in grads], dtype=self.shard.dtype, device=self.shard.device
        )
        scatter_in = self.layout.scatter_input_of(grads, flags)
        if self.pending_grads is not None:
            scatter_in.add_(self.pending_grads)
            self.pending_grads = None
        return scatter_in

    def start_scatter(self, scatter_in: torch.Tensor, streams: CommStreams | None) -> None:
        """Start the reduce-scatter of ``scatter_in`` (from :meth:`add_gradients`)
        asynchronously, on the communication stream where there is one."""
        primitive = self.scatter_primitive or self.primitive
        _ready_for_comm(streams)
        nbytes: int | None = None
        if self.codec is not None and self.codec_role == "scatter":
            nbytes, wire = self.codec.wire("scatter", scatter_in.numel(), self.layout.world_size)
        else:
            wire = self._phased(scatter_in.numel(), scatter_in.dtype)
        with _on(streams), self.traced("scatter", nbytes, wire) as handle:
            if self.codec is not None and self.codec_role == "scatter":
                work, result = self.codec.start_scatter(scatter_in, self.group)
                self.codec_trace = handle.event if handle is not None else None
            elif self.hierarchy is not None:
                work, result = self.hierarchy.reduce_scatter_start(scatter_in)
            else:
                work, result = reduce_scatter_start(
                    scatter_in, self.rank, self.layout.world_size, primitive, self.group
                )
            if handle is not None:
                handle.work = work
        self.scattering = (work, result, scatter_in)  # the input lives until waited for

    def flush_scatter(self, streams: CommStreams | None) -> None:
        """At the end of backward: start the reduce-scatter of gradients still summed here
        (a call of the unit never got its backward), then finish it."""
        self.open_calls = 0
        if self.pending_grads is not None:
            grads, self.pending_grads = self.pending_grads, None
            self.start_scatter(grads, streams)
        self.finish_scatter(streams)

    def finish_scatter(self, streams: CommStreams | None) -> None:
        """Wait for the reduce-scatter in flight (if any), average (across replicas too)
        and set the gradient of every parameter some rank used."""
        if self.scattering is None:
            return
        work, result, _scatter_in = self.scattering
        self.scattering = None
        if work is not None:
            work.wait()
        _wait_comm(streams)
        shard_grad: torch.Tensor = result()  # the mean over the shard group
        if self.codec is not None and self.codec_role == "scatter":
            shard_grad = self._checked_scatter(shard_grad, _scatter_in, streams)
        if self.replicas > 1:  # HSDP: the same shard on every replica, averaged across them
            shard_grad.div_(self.replicas)
            self._replicate(shard_grad)
        self._set_grads(shard_grad)

    def _checked_scatter(
        self, summed: torch.Tensor, scatter_in: torch.Tensor, streams: CommStreams | None
    ) -> torch.Tensor:
        """The mean from the codec's sum, or, where some rank flagged it (every rank of
        the group sees a non-finite sum), from the exact reduce-scatter redone now."""
        assert self.codec is not None
        world = self.layout.world_size
        if self._codec_result(usable(summed), "scatter"):
            return summed.div_(world)
        wire = scatter_in if self.codec.fallback == "fp32" else scatter_in.to(torch.bfloat16)
        primitive = self.scatter_primitive or self.primitive
        with _on(streams), self.traced("scatter", _nbytes(wire), _one_call(wire)):
            work, result = reduce_scatter_start(wire, self.rank, world, primitive, self.group)
            if work is not None:
                work.wait()
        _wait_comm(streams)
        return result().to(self.shard.dtype)

    def _replicate(self, shard_grad: torch.Tensor) -> None:
        """Sum the (pre-averaged) shard gradient across the replicas, in place."""
        codec = self.codec if self.codec_role == "replicate" else None
        if codec is None:
            with self.traced("replicate", _nbytes(shard_grad), _one_call(shard_grad)):
                dist.all_reduce(shard_grad, group=self.replicate_group)
            return
        nbytes, wire = codec.wire("replicate", shard_grad.numel(), self.replicas)
        with self.traced("replicate", nbytes, wire) as handle:
            summed = codec.all_reduce(shard_grad, self.replicate_group)
            self.codec_trace = handle.event if handle is not None else None
        if self._codec_result(usable(summed), "replicate"):
            shard_grad.copy_(summed[: shard_grad.numel()])
            return
        dtype = shard_grad.dtype if codec.fallback == "fp32" else torch.bfloat16
        exact = {dtype_name(dtype): shard_grad.numel() * dtype.itemsize}
        with self.traced("replicate", sum(exact.values()), exact):
            exact_all_reduce(shard_grad, self.replicate_group, codec.fallback)

    def _codec_result(self, ok: bool, role: str) -> bool:
        """Record the codec's step (residuals, trace, a fallback taken); returns ``ok``."""
        assert self.codec is not None
        self.codec.commit(ok)
        event, self.codec_trace = self.codec_trace, None
        if ok and event is None:  # statistics wait for the device: only when wanted
            return ok
        stats = self.codec.stats()
        if event is not None:
            event.codec = {**stats, "role": role, "used": ok}
        if not ok and self.observer is not None:
            why = stats.get("flagged") or "another rank flagged it (or the sum is not finite)"
            node = self.nodes.get(role, f"{self.layout.name}.{role}")
            what = f"{self.codec.name} sum not used"
            self.observer.fallback(node, self.codec.fallback, f"{what}: {why}")
        return ok

    def _set_grads(self, shard_grad: torch.Tensor) -> None:
        """Give every parameter some rank used its shard of ``shard_grad``."""
        layout = self.layout
        flags = shard_grad[layout.flag_offset : layout.flag_offset + len(layout.params)]
        used = (flags > 0).tolist()
        locals_ = layout.local_views(shard_grad, self.rank)
        for k, p in enumerate(layout.params):
            if not used[k]:
                continue  # no rank used it: grad stays as it was (None), as under DDP
            param = self.params[p.name]
            local = locals_[p.name]
            if param.grad is None:
                param.grad = self.make_grad(param, local)
            else:
                _local_of(param.grad).add_(local)


class _GatherUnit(torch.autograd.Function):
    """anchor -> the unit's parameters as views of its unsharded buffer (one output
    each); backward: start the unit's reduce-scatter of their gradients."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, unit: UnitState, engine: Zero3Engine
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit, ctx.engine = unit, engine
        ctx.set_materialize_grads(False)  # None: autograd did not reach that parameter
        full = unit.wait_gather("bwd" if engine.in_backward else "fwd", engine.streams)
        views = tuple(unit.layout.views(full).values())
        frozen = [
            v for v, p in zip(views, unit.layout.params, strict=True) if p.name in unit.frozen
        ]
        if frozen:  # no gradient is computed for a frozen parameter, as without sharding
            ctx.mark_non_differentiable(*frozen)
        return views

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:  # type: ignore[override]
        unit: UnitState = ctx.unit
        engine: Zero3Engine = ctx.engine
        scatter_in = unit.add_gradients(grads)
        unit.open_calls = max(0, unit.open_calls - 1)
        engine.reached(unit)
        if unit.open_calls > 0:  # called again in the forward: one reduce-scatter, at the end
            unit.pending_grads = scatter_in
            return None, None, None
        unit.start_scatter(scatter_in, engine.streams)
        engine.uninstall(unit)
        unit.release()
        engine.scatter_started(unit)
        return None, None, None


@dataclass
class CommStreams:
    """The handle and its communication stream, and the compute stream they order against."""

    handle: DeviceHandle
    comm: Stream
    compute: Stream


def comm_streams(handle: DeviceHandle | None, device: torch.device) -> CommStreams | None:
    """A communication stream from ``handle`` (None on the CPU or where streams are
    unsupported: work is then issued on the current stream)."""
    if handle is None or device.type == "cpu":
        return None
    try:
        return CommStreams(handle, handle.new_stream(device), handle.current_stream(device))
    except Exception:  # NotSupportedError (XLA orders work in its lazy graph)
        return None


def _on(streams: CommStreams | None) -> AbstractContextManager[None]:
    return nullcontext() if streams is None else streams.handle.use_stream(streams.comm)


def _ready_for_comm(streams: CommStreams | None) -> None:
    """The comm stream waits for what compute wrote (the gradient)."""
    if streams is not None:
        streams.comm.wait_stream(streams.compute)


def _record(streams: CommStreams | None) -> Any:
    return None if streams is None else streams.comm.record_event()


def _wait(streams: CommStreams | None, event: Any) -> None:
    """Compute waits for a gather issued on the comm stream."""
    if streams is not None and event is not None:
        streams.compute.wait_event(event)


def _wait_comm(streams: CommStreams | None) -> None:
    if streams is not None:
        streams.compute.wait_stream(streams.comm)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _one_call(tensor: torch.Tensor) -> dict[str, int]:
    """What one collective call of ``tensor`` hands to ``torch.distributed``."""
    return {dtype_name(tensor.dtype): _nbytes(tensor)}


def _local_of(tensor: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = getattr(tensor, "_local_tensor", tensor)
    return local


class Zero3Engine:
    """Installs and removes gathered parameter views around each unit's forward, and
    collects the reduce-scatters of a backward.

    Backward can need a unit's module to hold its gathered parameters again: activation
    checkpointing recomputes a forward inside backward, and where the recomputation runs
    outside the unit's module hooks (torch's ``checkpoint_wrapper``, transformers'
    checkpointed layers) only the engine can put them there. So every unit's forward
    output carries a gradient hook that installs the unit's views when backward reaches
    it; the unit's gradient backward (or the end of backward) puts the sharded
    parameters back. Frozen units have no gradient backward: one gathered again in
    backward is freed once backward has moved on to a unit before it.
    """

    def __init__(
        self,
        units: list[UnitState],
        root: nn.Module,
        reshard_after_forward: bool = True,
        streams: CommStreams | None = None,
    ) -> None:
        self.units = units
        self.root = root
        #: False keeps each unit's unsharded buffer from its forward until its backward
        #: (less communication, more memory).
        self.reshard_after_forward = reshard_after_forward
        self.streams = streams
        self._by_storage: dict[int, UnitState] = {}
        self._forward_order: list[UnitState] = []
        self._recording = True
        #: id(order list) -> (its length, id(unit) -> first position): see _position
        self._positions: dict[int, tuple[int, dict[int, int]]] = {}
        #: Told when a backward starts and ends (the run log, for tracing).
        self.observer: GatherObserver | None = None
        self._in_backward = False
        self._scattered: list[UnitState] = []
        self._in_flight: list[UnitState] = []
        #: Units whose modules hold gathered views installed during backward.
        self._installed: dict[int, UnitState] = {}
        #: Frozen units gathered during backward (no gradient backward frees them).
        self._held_frozen: dict[int, UnitState] = {}
        #: True while every module holds whole plain parameters (``full_parameters``):
        #: the hooks then leave the modules alone.
        self.summoned = False

    @property
    def in_backward(self) -> bool:
        """Whether a backward through the units is running."""
        return self._in_backward

    # -- forward ------------------------------------------------------------------------
    def enter_unit(self, unit: UnitState) -> None:
        """Gather ``unit``, prefetch the next one, install its parameter views. During
        backward (a recomputed forward, or backward reaching the unit) the views are
        built with autograd on, as the forward built them, so that a recomputation saves
        what the forward saved."""
        if self.summoned:
            return
        backward = self._in_backward
        if self._recording and not backward:
            self._forward_order.append(unit)
        with torch.enable_grad() if backward else nullcontext():
            views: tuple[torch.Tensor, ...] = _GatherUnit.apply(unit.anchor, unit, self)  # type: ignore[no-untyped-call]
        if any(v.requires_grad for v in views) and not backward:
            # its backward will run, once per call. A forward recomputed during backward
            # (activation checkpointing) is not a call: autograd only takes the tensors
            # it saves, and no gradient flows back through it
            unit.open_calls += 1
        self._by_storage[views[0].untyped_storage().data_ptr()] = unit
        if backward:
            self._installed[id(unit)] = unit
            self._hold_if_frozen(unit)
            self._moved_to(unit)
            previous = self._previous_of(unit)
            if previous is not None and previous.planned_bwd_gather:
                previous.start_gather("bwd", self.streams)
        else:
            nxt = self._next_after(unit)
            if nxt is not None:
                nxt.start_gather("fwd", self.streams)
        self._install(unit, views)

    def leave_unit(self, unit: UnitState, output: Any = None) -> None:
        """Put the sharded parameters back and (when resharding after forward) drop the
        buffer; autograd keeps tokens, not the buffer, and backward gathers again. A
        training forward's ``output`` gets the gradient hook that reinstalls the unit's
        views when backward reaches it."""
        if self.summoned:
            return
        self.put_back(unit)
        if output is not None and not self._in_backward and torch.is_grad_enabled():
            self.enter_on_backward(output, (unit,))
        if self.reshard_after_forward and not self._kept(unit):
            unit.release()

    def _kept(self, unit: UnitState) -> bool:
        """Whether ``unit`` stays gathered after its forward: a unit the plan keeps for
        backward, when backward may read it (trained parameters or, for a frozen unit, a
        forward with autograd on), and always while backward runs (it is freed when its
        gradient backward, or backward, ends)."""
        if not unit.keep_for_backward:
            return False
        if self._in_backward:
            return True
        return unit.open_calls > 0 or (unit.all_frozen and torch.is_grad_enabled())

    def enter_on_backward(self, output: Any, units: tuple[UnitState, ...]) -> None:
        """When backward reaches any tensor of ``output`` that requires grad, install the
        views of ``units`` (once), so that a recomputed forward finds them."""
        tensors = [
            t
            for t in tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
        ]
        if not tensors:
            return
        done = [False]

        def reached(_grad: torch.Tensor) -> None:
            if done[0]:
                return
            done[0] = True
            self._begin_backward()
            for unit in units:
                if id(unit) not in self._installed:
                    self.enter_unit(unit)

        for tensor in tensors:
            tensor.register_hook(reached)  # type: ignore[no-untyped-call]

    def _install(self, unit: UnitState, views: tuple[torch.Tensor, ...]) -> None:
        for p, view in zip(unit.layout.params, views, strict=True):
            for module, attr in unit.places[p.name]:
                module._parameters[attr] = view  # type: ignore[assignment]

    def put_back(self, unit: UnitState) -> None:
        """The modules hold ``unit``'s sharded parameters again."""
        for name, places in unit.places.items():
            for module, attr in places:
                module._parameters[attr] = unit.params[name]
        self._installed.pop(id(unit), None)
        if unit.full is not None:
            self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)

    def uninstall(self, unit: UnitState) -> None:
        """``unit``'s backward is done: views installed for it during backward go."""
        if id(unit) in self._installed:
            self.put_back(unit)

    def drop_stale_prefetches(self) -> None:
        """Before a forward: no unit keeps a buffer gathered before the optimizer step,
        nor calls whose backward never ran."""
        for unit in self.units:
            unit.release()
            unit.open_calls = 0
            unit.pending_grads = None
        self._held_frozen.clear()

    def finish_forward(self) -> None:
        """The first forward fixed the unit order used for prefetching."""
        self._recording = False

    def _next_after(self, unit: UnitState) -> UnitState | None:
        order = self._forward_order if not self._recording else self.units
        k = self._position(order, unit)
        return order[k + 1] if k is not None and k + 1 < len(order) else None

    def _previous_of(self, unit: UnitState) -> UnitState | None:
        order = self._forward_order or self.units
        k = self._position(order, unit)
        return order[k - 1] if k is not None and k > 0 else None

    def _position(self, order: list[UnitState], unit: UnitState) -> int | None:
        """Where ``unit`` first appears in ``order`` (None: nowhere), by identity, from
        an index kept while ``order`` does not grow (called for every saved tensor that
        backward unpacks)."""
        cached = self._positions.get(id(order))
        if cached is None or cached[0] != len(order):
            index: dict[int, int] = {}
            for k, u in enumerate(order):
                index.setdefault(id(u), k)
            cached = (len(order), index)
            self._positions[id(order)] = cached
        return cached[1].get(id(unit))

    # -- backward -------------------------------------------------------------------------
    def reached(self, unit: UnitState) -> None:
        """Backward reached ``unit``; the end of backward finishes its reduce-scatter."""
        self._scattered.append(unit)
        self._begin_backward()

    def scatter_started(self, unit: UnitState) -> None:
        """``unit`` started its reduce-scatter: finish the ones started before it, which
        had the backward of ``unit`` to overlap with. At most two are in flight, so their
        buffers (the size of the unsharded gradients) do not pile up over a backward."""
        earlier, self._in_flight = self._in_flight, [unit]
        for other in earlier:
            other.finish_scatter(self.streams)

    def _hold_if_frozen(self, unit: UnitState) -> None:
        """A frozen unit gathered during backward is held until backward moves on."""
        if unit.all_frozen and not unit.keep_for_backward and self.reshard_after_forward:
            self._held_frozen[id(unit)] = unit

    def _moved_to(self, unit: UnitState) -> None:
        """Backward reached ``unit``: frozen units after it in forward order, gathered
        for their part of backward, are done (one needed again is gathered again)."""
        if not self._held_frozen or unit.keep_for_backward:
            return  # a unit kept for backward (the root) is read all through it
        order = self._forward_order or self.units
        here = self._position(order, unit)
        if here is None:
            return
        for key, other in list(self._held_frozen.items()):
            there = self._position(order, other)
            if other is not unit and there is not None and there > here:
                del self._held_frozen[key]
                self.uninstall(other)
                other.release()

    def _begin_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            if self.observer is not None:
                self.observer.begin_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._in_backward = False
        if self.observer is not None:
            self.observer.end_backward()
        scattered, self._scattered = self._scattered, []
        done: set[int] = set()
        for unit in scattered:
            if id(unit) not in done:  # a unit called twice is listed twice
                done.add(id(unit))
                unit.flush_scatter(self.streams)
        self._in_flight = []
        self._held_frozen.clear()
        self._restore_parameters()
        for unit in self.units:  # frozen units kept for backward included
            unit.release()

    def _restore_parameters(self) -> None:
        """Every module holds its sharded parameters again: a forward recomputed during
        backward (activation checkpointing) may stop early, before a unit's forward hook
        put them back."""
        for unit in self.units:
            for name, places in unit.places.items():
                for module, attr in places:
                    if module._parameters[attr] is not unit.params[name]:
                        module._parameters[attr] = unit.params[name]
        self._by_storage.clear()
        self._installed.clear()

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
        self._begin_backward()
        unit = packed.unit
        self._moved_to(unit)
        full = unit.wait_gather("bwd", self.streams)
        self._hold_if_frozen(unit)
        previous = self._previous_of(unit)
        if previous is not None and previous.planned_bwd_gather:
            previous.start_gather("bwd", self.streams)  # backward runs the units in reverse
        view = full.as_strided(packed.shape, packed.stride, packed.offset)
        return view


@dataclass(frozen=True)
class _Token:
    unit: UnitState
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
