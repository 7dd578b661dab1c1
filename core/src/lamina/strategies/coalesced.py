"""Broadcast many tensors of one dtype, small ones as flat buffers of bounded size (few
collectives, not one each, and no flat copy of a whole model), as the execution plan's
broadcast nodes say: one node per dtype."""

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


#: Bytes of small tensors flattened into one broadcast: bounded, so that the setup
#: broadcast of a large model holds no flat copy of it.
COALESCE_BYTES = 4 << 20


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], source: int, group: dist.ProcessGroup | None = None
) -> None:
    """Give every rank ``source``'s values of ``tensors`` (all of one dtype and device):
    small ones flattened together up to :data:`COALESCE_BYTES` a broadcast, a larger
    contiguous one broadcast in place (no copy)."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        pending: list[torch.Tensor] = []
        pending_bytes = 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes >= COALESCE_BYTES and tensor.is_contiguous():
                dist.broadcast(tensor.data, src=source, group=group)
                continue
            if pending and pending_bytes + nbytes > COALESCE_BYTES:
                _broadcast_flat(pending, source, group)
                pending, pending_bytes = [], 0
            pending.append(tensor)
            pending_bytes += nbytes
        if pending:
            _broadcast_flat(pending, source, group)


def _broadcast_flat(
    tensors: Sequence[torch.Tensor], source: int, group: dist.ProcessGroup | None
) -> None:
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
