"""The collective algorithms of lamina's plans as traceable functional collectives.

What the eager engines issue with ``torch.distributed`` calls (:mod:`lamina.comm.algorithms`
for DP's buckets, :mod:`lamina.memory.hierarchy` for ZeRO-3's units), written with
``torch.distributed._functional_collectives`` so a captured step holds them: one phase of
a gather or a reduce-scatter over a group, in the backend's native form or in gloo's
faster forms (one broadcast per member; an ``all_to_all`` and a local sum), and the
hierarchical all-reduce (inside each host, across the hosts, inside again), in chunks
for the pipelined one. :func:`phase_calls` and :func:`hierarchical_calls` say which
calls each issues, for the check of the captured graph against the plan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

from lamina.strategies.compiled.graph_collectives import PlannedCall


def _pg(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    return pg


def gather_over(part: torch.Tensor, group: dist.ProcessGroup | None, native: bool) -> torch.Tensor:
    """Every member's ``part``, in group-rank order: ``all_gather``, or one broadcast
    per member (gloo)."""
    pg = _pg(group)
    if native:
        gathered: torch.Tensor = funcol.all_gather_tensor(part, 0, pg)
        return gathered
    mine = dist.get_rank(pg)
    slots = [  # the source is the group's rank k
        funcol.broadcast(part if k == mine else torch.zeros_like(part), k, pg)
        for k in range(dist.get_world_size(pg))
    ]
    return torch.cat(slots)


def scatter_over(
    buffer: torch.Tensor, group: dist.ProcessGroup | None, native: bool
) -> torch.Tensor:
    """The sum over ``group`` of this rank's slot of ``buffer``: ``reduce_scatter``, or
    an ``all_to_all`` and a local sum (gloo)."""
    pg = _pg(group)
    if native:
        summed: torch.Tensor = funcol.reduce_scatter_tensor(buffer, "sum", 0, pg)
        return summed
    received = funcol.all_to_all_single(buffer, None, None, pg)
    total: torch.Tensor = received.view(dist.get_world_size(pg), -1).sum(0)
    return total


def gather_calls(node: str, members: int, part: int, native: bool) -> list[PlannedCall]:
    """The calls of :func:`gather_over` for ``part``-element parts over ``members``."""
    if native:
        return [PlannedCall(node, "all_gather", members * part)]
    return [PlannedCall(node, "broadcast", part)] * members


def scatter_call(node: str, numel: int, native: bool) -> PlannedCall:
    """The call of :func:`scatter_over` of a ``numel``-element buffer."""
    return PlannedCall(node, "reduce_scatter" if native else "all_to_all", numel)


def _pieces(numel: int, local: int, chunks: int) -> int:
    """Elements of each chunk: a multiple of ``local`` (the buffer padded to fit)."""
    return -(-numel // (chunks * local)) * local


def hierarchical_all_reduce(
    flat: torch.Tensor,
    intra: dist.ProcessGroup | None,
    inter: dist.ProcessGroup | None,
    local: int,
    native: bool,
    chunks: int = 1,
) -> torch.Tensor:
    """The sum of ``flat`` over the hosts' ranks: per chunk, reduce-scatter inside the
    host (``local`` ranks), all-reduce the shard across the hosts, gather inside."""
    numel = flat.numel()
    piece = _pieces(numel, local, chunks)
    padded = F.pad(flat, (0, piece * chunks - numel))
    summed = []
    for k in range(chunks):
        shard = scatter_over(padded[k * piece : (k + 1) * piece], intra, native)
        shard = funcol.all_reduce(shard, "sum", _pg(inter))
        summed.append(gather_over(shard, intra, native))
    return torch.cat(summed)[:numel]


def hierarchical_calls(
    node: str, numel: int, local: int, native: bool, chunks: int = 1
) -> list[PlannedCall]:
    """The calls of :func:`hierarchical_all_reduce` of a ``numel``-element buffer."""
    piece = _pieces(numel, local, chunks)
    calls: list[PlannedCall] = []
    for _ in range(chunks):
        calls.append(scatter_call(node, piece, native))
        calls.append(PlannedCall(node, "all_reduce", piece // local))
        calls += gather_calls(node, local, piece // local, native)
    return calls
