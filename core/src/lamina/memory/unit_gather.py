"""Gathering a unit's parameters into its unsharded buffer, and freeing the buffer.

Each unit owns one flat shard buffer per rank (see :mod:`lamina.memory.layout`); the
model's parameters are views of it, so the optimizer updates it in place. How the
unsharded buffer is filled depends on the primitive: ``all_gather_into_tensor`` (on
gloo, one broadcast per rank) gives the rank-major gathered buffer, copied out in one
fused copy; the all-reduce form sums buffers that already have the unsharded layout
(each rank's rows in place, zeros elsewhere), so nothing is copied out; a unit the plan
gives the hierarchical algorithm gathers in two phases, inside then across hosts
(:mod:`lamina.memory.hierarchy`); with one rank the shard buffer itself (or its cast to
the compute dtype) is the unsharded buffer. A gather is started asynchronously, on the
communication stream where the device has one (:mod:`lamina.memory.streams`), and
waited for when the buffer is needed; freeing the buffer first finishes a gather still
in flight, so that every rank completes the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lamina.device.handle import Event
from lamina.memory.gather import gather_full, gather_unsharded
from lamina.memory.streams import CommStreams, on_comm, ready_for_comm, record_comm, wait_event
from lamina.memory.unit_config import UnitConfig
from lamina.works import AllWorks


@dataclass
class PendingGather:
    """A gather in flight, until it is waited for."""

    #: The buffer the gather fills.
    buffer: torch.Tensor
    #: What to wait for (None: nothing, the buffer is ready).
    work: dist.Work | AllWorks | None
    #: Marks the gather on the comm stream (None: no streams, or nothing issued).
    event: Event | None
    #: What is gathered (the shard, or its cast): on a device the comm stream may still
    #: read it after the gather was issued, so it lives until the gather is waited for.
    source: torch.Tensor
    #: Whether ``buffer`` is laid out unsharded already (nothing to copy out).
    in_place: bool


class UnitGather:
    """A unit's gather path on this rank: its unsharded buffer while the unit is
    gathered, the gather in flight, and the number of gathers issued."""

    def __init__(self, config: UnitConfig) -> None:
        self.config = config
        #: The unsharded buffer while the unit is gathered.
        self.full: torch.Tensor | None = None
        #: The gather in flight (None: none).
        self.pending: PendingGather | None = None
        #: Gathers issued so far (for tests and inspection).
        self.gathers = 0

    def start_gather(self, phase: str = "fwd", streams: CommStreams | None = None) -> None:
        """Begin gathering the shard buffers (asynchronously where the backend allows);
        ``phase`` ("fwd"/"bwd") names the plan node it serves."""
        if self.full is not None or self.pending is not None:
            return
        config = self.config
        dtype = config.compute_dtype or config.shard.dtype
        layout = config.layout
        with torch.no_grad():
            source = config.shard.detach().to(dtype)  # mixed precision: gather fewer bytes
            if layout.world_size == 1:  # the shard (or its cast) is the unsharded buffer
                unsharded = source.narrow(0, 0, layout.flag_offset)
                self.pending = PendingGather(unsharded, None, None, source, True)
            else:
                # the all-reduce form sums buffers already laid out unsharded
                in_place = config.primitive == "all_reduce"
                buffer = torch.empty(layout.total_numel, dtype=dtype, device=source.device)
                ready_for_comm(streams)  # the shards the optimizer wrote, on compute
                work: dist.Work | AllWorks | None
                wire = config.phased(layout.total_numel, dtype)
                with on_comm(streams), config.traced(phase, wire=wire) as handle:
                    if config.hierarchy is not None:
                        in_place = False
                        work = config.hierarchy.gather(source, buffer)
                    elif in_place:
                        work = gather_unsharded(source, buffer, layout, config.rank, config.group)
                    else:
                        work = gather_full(
                            source,
                            buffer,
                            config.rank,
                            config.primitive,
                            config.group,
                            async_op=True,
                        )
                    if handle is not None:
                        handle.work = work
                # ``source`` lives until the gather is waited for: on a device the comm
                # stream may still read it after this call returns
                self.pending = PendingGather(buffer, work, record_comm(streams), source, in_place)
        self.gathers += 1

    def wait_gather(self, phase: str = "fwd", streams: CommStreams | None = None) -> torch.Tensor:
        """The unsharded buffer, gathering now if no gather is in flight."""
        if self.full is None:
            self.start_gather(phase, streams)
            pending = self.pending
            assert pending is not None  # started just now, or in flight already
            if pending.work is not None:
                pending.work.wait()
            wait_event(streams, pending.event)
            self.pending = None
            layout = self.config.layout
            buffer = pending.buffer
            if pending.in_place:
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
        config = self.config
        layout, shard = config.layout, config.shard
        gathered = torch.empty(layout.total_numel, dtype=shard.dtype, device=shard.device)
        with torch.no_grad():
            gather_full(shard.detach(), gathered, config.rank, config.primitive, config.group)
            unsharded = torch.empty(layout.unsharded_numel, dtype=shard.dtype, device=shard.device)
            return layout.copy_out(gathered, unsharded)

    def release(self) -> None:
        """Drop the unsharded buffer and any gather still in flight (finished first, so
        that every rank completes the same collectives)."""
        if self.pending is not None:
            if self.pending.work is not None:
                self.pending.work.wait()
            self.pending = None
        self.full = None
