"""Broadcast many tensors of one dtype as one flat buffer (one collective, not one each),
as the execution plan's broadcast nodes say."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lamina.dtypes import dtype_name
from lamina.runtime import RunLog


def dtype_totals(tensors: Sequence[torch.Tensor]) -> list[tuple[str, int]]:
    """(dtype name, total elements) per dtype, in order of first appearance."""
    totals: dict[str, int] = {}
    for tensor in tensors:
        name = dtype_name(tensor.dtype)
        totals[name] = totals.get(name, 0) + tensor.numel()
    return [(name, numel) for name, numel in totals.items() if numel > 0]


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], source: int, group: dist.ProcessGroup | None = None
) -> None:
    """Give every rank ``source``'s values of ``tensors`` (all of one dtype and device)."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        dist.broadcast(flat, src=source, group=group)
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            tensor.data.copy_(flat[offset : offset + n].view_as(tensor))
            offset += n


def run_broadcast_nodes(
    log: RunLog,
    phase: str,
    tensors: Sequence[torch.Tensor],
    source: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Run the plan's broadcast nodes of ``phase``, each over the ``tensors`` of its dtype."""
    for node in log.plan.collectives():
        spec = node.collective
        if node.phase == phase and spec is not None and spec.op == "broadcast":
            chosen = [t for t in tensors if dtype_name(t.dtype) == spec.dtype]
            with log.collective(node.id):
                broadcast_coalesced(chosen, source, group)
