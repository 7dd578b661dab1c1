"""The two collectives of ZeRO-3, chosen per backend: gather a unit, scatter its gradient.

On NCCL (and other device backends) they are ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (``"native"``). On gloo both are slower than an all-reduce of
the same buffer, which moves twice the bytes; there the gather is one broadcast per rank
of that rank's slot (``"broadcast"``) and the reduce-scatter an ``all_to_all`` of the
slots followed by a local sum (``"all_to_all"``). The all-reduce forms (``"all_reduce"``:
a zero buffer holding this rank's shard, summed; the full gradient summed, then this
rank's slot) work everywhere. Which form a unit uses is decided by its execution plan
(:mod:`lamina.runtime.primitives`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from lamina.works import AllWorks

if TYPE_CHECKING:
    from lamina.memory.layout import UnitLayout

Primitive = Literal["native", "all_reduce", "broadcast", "all_to_all"]


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def gather_full(
    shard: torch.Tensor,
    full: torch.Tensor,
    rank: int,
    primitive: Primitive,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | AllWorks | None:
    """Fill ``full`` with every rank's shard (rank r's shard at ``r * shard.numel()``)."""
    if full.numel() == shard.numel():  # one rank: the shard is the whole unit
        full.copy_(shard)
        return None
    if primitive == "broadcast":
        slots = full.view(-1, shard.numel())
        slots[rank].copy_(shard)
        works = [
            dist.broadcast(slot, _global_rank(group, k), group=group, async_op=True)
            for k, slot in enumerate(slots)
        ]
        gathered = AllWorks(works)
        if not async_op:
            gathered.wait()
        return gathered
    if primitive == "native":
        work: dist.Work | None = dist.all_gather_into_tensor(
            full, shard, group=group, async_op=async_op
        )
        return work
    full.zero_()
    full.narrow(0, rank * shard.numel(), shard.numel()).copy_(shard)
    reduced: dist.Work | None = dist.all_reduce(full, group=group, async_op=async_op)
    return reduced


def gather_unsharded(
    shard: torch.Tensor,
    buffer: torch.Tensor,
    layout: UnitLayout,
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> dist.Work | None:
    """The all-reduce form of the gather, straight into the unsharded layout: ``buffer``
    (``layout.total_numel``) gets this rank's shard at its place in the unsharded buffer
    (:meth:`UnitLayout.place_shard`, zeros elsewhere) and is summed over the ranks,
    asynchronously; afterwards ``buffer[:layout.unsharded_numel]`` is the unsharded
    buffer. The same bytes as :func:`gather_full`'s all-reduce, without its copy-out."""
    layout.place_shard(shard, buffer, rank)
    work: dist.Work | None = dist.all_reduce(buffer, group=group, async_op=True)
    return work


def reduce_scatter_start(
    scatter_in: torch.Tensor,
    rank: int,
    world_size: int,
    primitive: Primitive,
    group: dist.ProcessGroup | None = None,
) -> tuple[dist.Work | None, Callable[[], torch.Tensor]]:
    """Start averaging ``scatter_in`` (rank-major: ``world_size`` equal slots) over the
    ranks, asynchronously; returns the work (None when there is nothing to wait for)
    and a function giving this rank's slot of the mean (a tensor of its own, not a view
    of ``scatter_in``) once the work is done."""
    shard_numel = scatter_in.numel() // world_size
    if world_size == 1:
        return None, lambda: scatter_in  # the mean of one rank: itself
    if primitive == "native":
        out = torch.empty(shard_numel, dtype=scatter_in.dtype, device=scatter_in.device)
        work = dist.reduce_scatter_tensor(out, scatter_in, group=group, async_op=True)
        return work, lambda: out.div_(world_size)
    if primitive == "all_to_all":  # slot r of every rank arrives here; summed locally
        received = torch.empty_like(scatter_in)
        work = dist.all_to_all_single(received, scatter_in, group=group, async_op=True)
        return work, lambda: received.view(world_size, shard_numel).sum(0).div_(world_size)
    work = dist.all_reduce(scatter_in, group=group, async_op=True)
    # the division copies this rank's slot out: the W-times larger sum can be freed
    return work, lambda: torch.div(
        scatter_in.narrow(0, rank * shard_numel, shard_numel), world_size
    )
