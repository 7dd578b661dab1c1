"""ZeRO-3's gather and reduce-scatter in two phases, for a shard group spread on hosts.

A flat reduce-scatter over ranks launched with hosts interleaved sends most slots over
the slow links between hosts. The hierarchical form reduce-scatters inside each host
first, so that only ``1/L`` of the buffer (``L`` ranks per host) leaves it, and then
reduce-scatters that part across the hosts; the gather runs the same phases backwards
(gather across hosts, then inside the host).

Rank ``r`` must end with slot ``r`` of the buffer (its shard), exactly as the flat
collective gives it. The inside-host phase hands local rank ``l`` the ``l``-th of ``L``
contiguous chunks, and the cross-host phase hands each member of cross group ``l`` its
slot of that chunk; so chunk ``l`` must hold the slots of cross group ``l`` (ascending
ranks, as torch numbers a group). :attr:`HostHierarchy.order` lists the slots in that
order: for ranks numbered cyclically over the hosts (an interleaved launch) it is the
identity and the buffers are used as they are; otherwise one copy permutes the
reduce-scatter's input and one copy restores the gathered buffer.

On gloo the second phase may only start once the first has finished on this rank, so
both run on one worker thread (every hierarchical collective of the job on the same
thread, in the order the ranks issue them); inside a phase gloo uses the forms
:mod:`lamina.runtime.primitives` measured faster there (``all_to_all`` and a local sum,
one broadcast per rank). Device backends issue the phases from the caller in stream
order with their native ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lamina.memory.gather import Primitive, gather_full
from lamina.works import SerialWorker


@dataclass(frozen=True)
class HostHierarchy:
    """This rank's two groups and the slot order of one hierarchical shard group (the
    whole job: slot ``r`` is global rank ``r``'s shard)."""

    #: This rank's host: its ranks (ascending) and their process group.
    intra_ranks: tuple[int, ...]
    intra: dist.ProcessGroup | None
    #: This rank's cross-host group: the ranks of its local index on every host.
    inter_ranks: tuple[int, ...]
    inter: dist.ProcessGroup | None
    #: The slots in the order the two phases hand them out (see the module docstring).
    order: tuple[int, ...]
    #: Whether the backend's own all_gather / reduce_scatter run the phases (else gloo's
    #: faster forms).
    native: bool
    #: The thread the gloo phases run on (None: issue them from the caller).
    worker: SerialWorker | None = None
    _order_index: dict[str, torch.Tensor] = field(default_factory=dict, compare=False)

    @classmethod
    def for_rank(
        cls,
        hosts: Sequence[Sequence[int]],
        rank: int,
        intra: dist.ProcessGroup | None,
        inter: dist.ProcessGroup | None,
        *,
        native: bool,
        worker: SerialWorker | None = None,
    ) -> HostHierarchy:
        """Rank ``rank``'s view of ``hosts`` (each host's ranks; equal counts), given
        its host's group ``intra`` and its cross-host group ``inter``."""
        members = [sorted(h) for h in hosts]
        mine = next(h for h in members if rank in h)
        local = mine.index(rank)
        return cls(
            intra_ranks=tuple(mine),
            intra=intra,
            inter_ranks=tuple(sorted(h[local] for h in members)),
            inter=inter,
            order=cls.slot_order(hosts),
            native=native,
            worker=worker,
        )

    @classmethod
    def slot_order(cls, hosts: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """The slot order of ``hosts`` (each host's ranks; equal counts): local index by
        local index, each cross-host group's ranks ascending."""
        members = [sorted(h) for h in hosts]
        return tuple(
            r for local in range(len(members[0])) for r in sorted(h[local] for h in members)
        )

    @property
    def world_size(self) -> int:
        """Ranks in the shard group."""
        return len(self.order)

    @property
    def identity(self) -> bool:
        """Whether the slots are handed out in rank order (no permuting copy)."""
        return self.order == tuple(range(len(self.order)))

    def _index(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._order_index:
            self._order_index[key] = torch.tensor(self.order, dtype=torch.long, device=device)
        return self._order_index[key]

    def _run(self, phases: Callable[[], None]) -> Any:
        if self.worker is None:
            phases()
            return None
        return self.worker.submit(phases)

    # -- the two collectives -------------------------------------------------------------
    def gather(self, shard: torch.Tensor, full: torch.Tensor) -> Any:
        """Start filling ``full`` (``world_size`` slots) with every rank's ``shard``;
        returns a work to wait on (None when already done)."""
        hosts, local = len(self.inter_ranks), len(self.intra_ranks)
        size = shard.numel()
        staged = full if self.identity else torch.empty_like(full)
        chunks = staged.view(local, hosts * size)
        mine = chunks[self.intra_ranks.index(dist.get_rank())]

        def phases() -> None:
            self._all_gather(mine, shard, self.inter, self.inter_ranks).wait()
            self._all_gather(staged, mine, self.intra, self.intra_ranks).wait()
            if not self.identity:
                full.view(-1, size).index_copy_(0, self._index(full.device), staged.view(-1, size))

        return self._run(phases)

    def reduce_scatter_start(
        self, scatter_in: torch.Tensor
    ) -> tuple[Any, Callable[[], torch.Tensor]]:
        """Start averaging ``scatter_in`` (``world_size`` equal slots, rank-major) over
        the ranks; returns the work and a function giving this rank's slot of the mean
        once the work is done."""
        world = self.world_size
        size = scatter_in.numel() // world
        out: list[torch.Tensor] = []

        def phases() -> None:
            ordered = scatter_in
            if not self.identity:
                slots = scatter_in.view(world, size)
                ordered = slots.index_select(0, self._index(scatter_in.device)).view(-1)
            chunk = self._reduce_scatter(ordered, self.intra, len(self.intra_ranks))
            out.append(self._reduce_scatter(chunk, self.inter, len(self.inter_ranks)))

        work = self._run(phases)
        return work, lambda: out[0].div_(world)

    # -- one phase -----------------------------------------------------------------------
    def _all_gather(
        self,
        full: torch.Tensor,
        part: torch.Tensor,
        group: dist.ProcessGroup | None,
        members: tuple[int, ...],
    ) -> Any:
        position = members.index(dist.get_rank())  # group ranks follow ascending ranks
        form: Primitive = "native" if self.native else "broadcast"
        return gather_full(part, full, position, form, group, async_op=True)

    def _reduce_scatter(
        self, buffer: torch.Tensor, group: dist.ProcessGroup | None, members: int
    ) -> torch.Tensor:
        """The sum over ``group`` of this rank's slot of ``buffer`` (waited for)."""
        size = buffer.numel() // members
        if self.native:
            out = torch.empty(size, dtype=buffer.dtype, device=buffer.device)
            dist.reduce_scatter_tensor(out, buffer, group=group, async_op=True).wait()  # type: ignore[union-attr]
            return out
        received = torch.empty_like(buffer)
        dist.all_to_all_single(received, buffer, group=group, async_op=True).wait()  # type: ignore[union-attr]
        return received.view(members, size).sum(0)
