"""Context-parallel attention: each rank's queries against the whole sequence's keys.

Three algorithms (:data:`ALGORITHMS`), each exact (:mod:`.blocks`), forward and backward:

- ``all_gather``: every rank's keys and values gathered in one collective, attention
  block by block; backward gathers them again (so the whole sequence's keys and values
  are not held from forward to backward) and reduce-scatters their gradients back to
  their owners;
- ``pass_kv``: keys and values passed rank to rank around the ring, each transfer
  overlapped with the attention of the block that arrived before; in backward the
  key/value gradients travel with them and arrive home after a full turn;
- ``all_to_all`` (Ulysses): queries, keys and values exchanged so that each rank holds
  the whole sequence for ``heads / cp`` heads, attention over the whole sequence, and
  the output exchanged back (the head counts must divide by cp).

Tensors are ``(batch, heads, local tokens, head dim)`` as ``scaled_dot_product_attention``
takes them; key/value heads may be fewer than query heads (grouped-query attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lamina.strategies.cp.blocks import BlockAttention, Running, finish
from lamina.strategies.cp.comm import (
    ContextGroup,
    RingExchange,
    all_gather_flat,
    all_to_all_flat,
    reduce_scatter_flat,
)
from lamina.strategies.cp.masks import Masking
from lamina.strategies.cp.plan_nodes import site_nodes

#: The attention algorithms, by name.
ALGORITHMS = ("all_gather", "pass_kv", "all_to_all")


@dataclass(frozen=True)
class Call:
    """One attention call: its site (index in the forward), masking and scale."""

    site: int
    masking: Masking
    scale: float | None


def attend(
    algorithm: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, call: Call
) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v)`` over the global sequence, each tensor
    holding this rank's tokens."""
    if algorithm == "all_gather":
        out: torch.Tensor = _AllGatherAttention.apply(q, k, v, cp, call)  # type: ignore[no-untyped-call]
        return out
    if algorithm == "pass_kv":
        ringed: torch.Tensor = _RingAttention.apply(q, k, v, cp, call)  # type: ignore[no-untyped-call]
        return ringed
    if algorithm == "all_to_all":
        return _ulysses(q, k, v, cp, call)
    raise ValueError(f"unknown context-parallel attention algorithm {algorithm!r}")


def _saved(ctx: Any) -> tuple[Any, ...]:
    """``q, k, v`` and the per-chunk outputs and log-sum-exps saved for backward (saved
    through autograd, so saved-tensor hooks and memory accounting see them)."""
    q, k, v, *rest = ctx.saved_tensors
    half = len(rest) // 2
    return q, k, v, list(rest[:half]), list(rest[half:])


def _backward_inputs(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """What a block-wise backward starts from: the saved tensors (:func:`_saved`), the
    output's gradient cut into the engine's chunks, and zero query gradients for them."""
    q, k, v, outs, lses = _saved(ctx)
    grads = [c.contiguous() for c in torch.split(grad, ctx.engine.chunk, dim=2)]
    dq = [torch.zeros_like(g) for g in grads]
    return q, k, v, outs, lses, grads, dq


def _engine(cp: ContextGroup, call: Call) -> BlockAttention:
    return BlockAttention(call.masking, cp.layout.chunk, call.scale)


def _all_chunks(cp: ContextGroup) -> tuple[int, ...]:
    return tuple(c for r in range(cp.size) for c in cp.layout.chunks_of(r))


def _gathered(
    k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, node: str, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's keys and values (gathered order) in one all-gather."""
    parts = all_gather_flat(torch.stack([k, v]), cp, node, backward=backward)
    b, h, s, d = k.shape
    # (cp, 2, b, h, s, d) -> 2 x (b, h, cp * s, d)
    whole = parts.permute(1, 2, 3, 0, 4, 5).reshape(2, b, h, cp.size * s, d)
    return whole[0], whole[1]


class _AllGatherAttention(torch.autograd.Function):
    """This rank's queries over every rank's keys and values, gathered in one
    all-gather and attended block by block; backward gathers them again (the whole
    sequence's keys and values are not kept from forward to backward) and
    reduce-scatters their gradients to the ranks holding them."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, call: Call
    ) -> torch.Tensor:
        nodes = site_nodes(call.site)
        k_all, v_all = _gathered(k, v, cp, nodes.gather, backward=False)
        engine = _engine(cp, call)
        chunks = cp.layout.local_chunks
        running = [Running() for _ in chunks]
        engine.forward(running, q, chunks, k_all, v_all, _all_chunks(cp))
        out, outs, lses = finish(running, q.dtype)
        ctx.engine, ctx.cp, ctx.site = engine, cp, call.site
        ctx.save_for_backward(q, k, v, *outs, *lses)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, outs, lses, grads, dq = _backward_inputs(ctx, grad)
        engine: BlockAttention = ctx.engine
        cp: ContextGroup = ctx.cp
        nodes = site_nodes(ctx.site)
        k_all, v_all = _gathered(k, v, cp, nodes.regather, backward=True)
        chunks = cp.layout.local_chunks
        dk, dv = engine.backward(dq, grads, q, chunks, outs, lses, k_all, v_all, _all_chunks(cp))
        b, h, total, d = dk.shape
        stacked = torch.stack([dk, dv]).reshape(2, b, h, cp.size, total // cp.size, d)
        mine = reduce_scatter_flat(
            stacked.permute(3, 0, 1, 2, 4, 5), cp, nodes.scatter, backward=True
        )
        return torch.cat(dq, dim=2), mine[0], mine[1], None, None


class _RingAttention(torch.autograd.Function):
    """Keys and values passed around the ring (pass-KV), each transfer overlapped with
    the previous block's attention; backward passes their gradients along with them."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, call: Call
    ) -> torch.Tensor:
        engine = _engine(cp, call)
        nodes = site_nodes(call.site)
        chunks = cp.layout.local_chunks
        running = [Running() for _ in chunks]
        kv = torch.stack([k, v])
        for step in range(cp.size):
            source = (cp.index - step) % cp.size
            exchange = None
            if step < cp.size - 1:
                exchange = RingExchange(
                    kv, cp, nodes.send(step + 1), nodes.recv(step + 1), backward=False
                )
            engine.forward(running, q, chunks, kv[0], kv[1], cp.layout.chunks_of(source))
            if exchange is not None:
                kv = exchange.wait()
        out, outs, lses = finish(running, q.dtype)
        ctx.engine, ctx.cp, ctx.site = engine, cp, call.site
        ctx.save_for_backward(q, k, v, *outs, *lses)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, outs, lses, grads, dq = _backward_inputs(ctx, grad)
        engine: BlockAttention = ctx.engine
        cp: ContextGroup = ctx.cp
        nodes = site_nodes(ctx.site)
        chunks = cp.layout.local_chunks
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)
        for step in range(cp.size):
            source = (cp.index - step) % cp.size
            keys = None
            if step < cp.size - 1:
                keys = RingExchange(
                    kv, cp, nodes.send_back(step + 1), nodes.recv_back(step + 1), backward=True
                )
            dk, dv = engine.backward(
                dq, grads, q, chunks, outs, lses, kv[0], kv[1], cp.layout.chunks_of(source)
            )
            dkv = dkv + torch.stack([dk, dv])
            dkv = RingExchange(
                dkv, cp, nodes.send_grad(step + 1), nodes.recv_grad(step + 1), backward=True
            ).wait()
            if keys is not None:
                kv = keys.wait()
        return torch.cat(dq, dim=2), dkv[0], dkv[1], None, None


class _AllToAll(torch.autograd.Function):
    """Row ``j`` of ``x`` (``(cp, ...)``) to rank ``j``; backward: the same exchange of
    the gradient, which is its own adjoint."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextGroup, node: str, back: str) -> torch.Tensor:
        ctx.cp, ctx.back = cp, back
        return all_to_all_flat(x, cp, node, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return all_to_all_flat(grad, ctx.cp, ctx.back, backward=True), None, None, None


def _ulysses(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, call: Call
) -> torch.Tensor:
    """All-to-all over heads: this rank attends over the whole sequence for its share
    of the heads, then the outputs go back to the ranks holding their tokens."""
    nodes = site_nodes(call.site)
    n = cp.size
    b, heads, s, d = q.shape
    kv_heads = k.shape[1]

    def by_rank(t: torch.Tensor) -> torch.Tensor:  # (b, h, s, d) -> (b, n, h / n, s, d)
        return t.reshape(b, n, t.shape[1] // n, s, d)

    packed = torch.cat([by_rank(q), by_rank(k), by_rank(v)], dim=2).movedim(1, 0)
    arrived = _AllToAll.apply(packed, cp, nodes.heads_in, nodes.heads_in_back)  # type: ignore[no-untyped-call]
    # (n sources, b, h', s, d) -> (b, h', n * s, d) in global order
    width = arrived.shape[2]
    whole = arrived.permute(1, 2, 0, 3, 4).reshape(b, width, n * s, d)
    layout = cp.layout
    whole = whole.index_select(2, layout.to_global(q.device))
    qh, kh, vh = whole.split([heads // n, kv_heads // n, kv_heads // n], dim=1)
    masking = call.masking
    mask = None
    if masking.documents is not None:
        docs = masking.documents
        allowed = docs[:, :, None] == docs[:, None, :]
        if masking.causal:
            allowed = allowed & torch.ones_like(allowed[0]).tril()
        mask = allowed.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        attn_mask=mask,
        is_causal=masking.causal and mask is None,
        scale=call.scale,
        enable_gqa=kv_heads != heads,
    )
    # back to gathered order, one row per source rank
    out = out.index_select(2, layout.gathered_order(q.device))
    rows = out.reshape(b, heads // n, n, s, d).permute(2, 0, 1, 3, 4)
    returned = _AllToAll.apply(rows, cp, nodes.heads_out, nodes.heads_out_back)  # type: ignore[no-untyped-call]
    # (n head groups, b, h / n, s, d) -> (b, h, s, d)
    result: torch.Tensor = returned.movedim(0, 1).reshape(b, heads, s, d)
    return result
