"""Context parallelism's collectives and transfers, each recorded as its plan node.

:class:`ContextGroup` is this rank's cp group; every function here issues through
``torch.distributed`` and counts what it issued in the step's run log under the node
:mod:`.plan_nodes` names (:class:`~lamina.strategies.tp.activation_ops.StepLog`), so a
run that differs from its plan is visible to tests and to ``lamina trace``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lamina.strategies.cp.layout import SequenceLayout
from lamina.strategies.tp.activation_ops import StepLog


@dataclass(frozen=True)
class ContextGroup:
    """This rank's context-parallel group: the process group, its global ranks, this
    rank's index in it, the step log its collectives are counted in, and the scale every
    parameter gradient carries (``cp``: the sharder or replica sync that follows averages
    over the cp ranks, which hold one batch between them, so their sum is wanted)."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    index: int
    log: StepLog
    layout: SequenceLayout

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.index - 1) % self.size]


#: torch 2.13 renamed all_gather_into_tensor (deprecated there); 2.9 has only the old name.
_gather_into: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_from: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather_flat(x: torch.Tensor, cp: ContextGroup, node: str, backward: bool) -> torch.Tensor:
    """Every rank's ``x`` stacked on a new dim 0 (rank order)."""
    x = x.contiguous()
    out = torch.empty((cp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with cp.log.issuing(node, "all_gather", _nbytes(out), backward):
        _gather_into(out, x, group=cp.group)
    return out.view(cp.size, *x.shape)


def reduce_scatter_flat(
    x: torch.Tensor, cp: ContextGroup, node: str, backward: bool
) -> torch.Tensor:
    """``x`` (``(cp, ...)``) summed over ranks, this rank keeping row ``index``."""
    x = x.contiguous()
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    with cp.log.issuing(node, "reduce_scatter", _nbytes(x), backward):
        _scatter_from(out, x.flatten(0, 1), group=cp.group)
    return out


def all_to_all_flat(x: torch.Tensor, cp: ContextGroup, node: str, backward: bool) -> torch.Tensor:
    """``x`` (``(cp, ...)``): row ``j`` goes to rank ``j``; row ``j`` of the result came
    from rank ``j``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    with cp.log.issuing(node, "all_to_all", _nbytes(x), backward):
        dist.all_to_all_single(out, x, group=cp.group)
    return out


class RingExchange:
    """One step of a ring: ``tensor`` sent to the next rank while the previous rank's
    arrives, overlapped with whatever runs before :meth:`wait`."""

    def __init__(
        self, tensor: torch.Tensor, cp: ContextGroup, send_node: str, recv_node: str, backward: bool
    ) -> None:
        self.received = torch.empty_like(tensor)
        if backward:
            cp.log.backward_reached()
        run_log = cp.log.run_log
        run_log.transfer(send_node, _nbytes(tensor))
        run_log.transfer(recv_node, _nbytes(tensor))
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), cp.next_rank, cp.group),
            dist.P2POp(dist.irecv, self.received, cp.prev_rank, cp.group),
        ]
        self._works: list[Any] = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        """The tensor the previous rank sent."""
        for work in self._works:
            work.wait()
        return self.received


class GatherSequence(torch.autograd.Function):
    """This rank's tokens of an output gathered into the whole sequence (global order)
    on every cp rank; backward keeps this rank's tokens of the gradient, scaled by
    ``cp`` (see :class:`ContextGroup`) and without a collective: every rank computed the
    same loss from the same gathered output. ``sync`` (cp without a sharder) is queued to
    run after the backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, cp: ContextGroup, node: str, sync: Any
    ) -> torch.Tensor:
        ctx.dim, ctx.cp, ctx.sync = dim, cp, sync
        moved = x.movedim(dim, 0)
        parts = all_gather_flat(moved, cp, node, backward=False)
        whole = parts.flatten(0, 1)
        order = cp.layout.to_global(x.device)
        return whole.index_select(0, order).movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        cp: ContextGroup = ctx.cp
        if ctx.sync is not None:  # cp without a sharder: sync the gradients after backward
            ctx.sync.queue()
        local = cp.layout.shard(grad, ctx.dim)
        return local * cp.size, None, None, None, None
