"""The two collectives of ZeRO-3, chosen per backend: gather a unit, scatter its gradient.

On NCCL (and other device backends) they are ``all_gather_into_tensor`` and
``reduce_scatter_tensor``. On gloo both are about twice as slow as an all-reduce of the
same buffer (measured: 64 MB reduce_scatter/all_gather ~140 ms vs all_reduce ~75 ms on
2 ranks), so there the gather is an all-reduce of a zero buffer holding this rank's shard
and the reduce-scatter is an all-reduce followed by taking this rank's slice. Which
form a unit uses is decided by its execution plan (:mod:`lamina.runtime.primitives`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

Primitive = Literal["native", "all_reduce"]


def gather_full(
    shard: torch.Tensor,
    full: torch.Tensor,
    rank: int,
    primitive: Primitive,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Fill ``full`` with every rank's shard (rank r's shard at ``r * shard.numel()``)."""
    if full.numel() == shard.numel():  # one rank: the shard is the whole unit
        full.copy_(shard)
        return None
    if primitive == "native":
        work: dist.Work | None = dist.all_gather_into_tensor(
            full, shard, group=group, async_op=async_op
        )
        return work
    full.zero_()
    full.narrow(0, rank * shard.numel(), shard.numel()).copy_(shard)
    reduced: dist.Work | None = dist.all_reduce(full, group=group, async_op=async_op)
    return reduced


def reduce_scatter_mean(
    grad_full: torch.Tensor,
    rank: int,
    world_size: int,
    primitive: Primitive,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's slice of the mean over ranks of ``grad_full``."""
    shard_numel = grad_full.numel() // world_size
    if world_size == 1:
        return grad_full.clone()
    if primitive == "native":
        out = torch.empty(shard_numel, dtype=grad_full.dtype, device=grad_full.device)
        dist.reduce_scatter_tensor(out, grad_full.contiguous(), group=group)
        return out.div_(world_size)
    reduced = grad_full.contiguous().clone()
    dist.all_reduce(reduced, group=group)
    return reduced.narrow(0, rank * shard_numel, shard_numel).div_(world_size).clone()
