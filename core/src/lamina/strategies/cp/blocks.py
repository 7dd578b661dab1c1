"""Exact attention computed block by block: an online softmax across key blocks.

Each block (a chunk of queries against a chunk of keys, :mod:`.masks`) runs torch's
fused attention kernel, which returns the block's output and the log-sum-exp of each
query's scores. Blocks merge as ``lse = logaddexp(lse_a, lse_b)``,
``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``: the result equals one
softmax over every key. Backward runs the kernel's backward per block with the merged
output and log-sum-exp, which gives each block's exact share of the query gradient and
its keys' whole gradient. Grouped-query key/value heads are repeated for the kernel and
their gradients summed back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lamina.strategies.cp.masks import FULL, SKIP, Block, Masking

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output and log-sum-exp (float32, ``(batch, heads, q)``)."""
    if q.device.type == "cpu":
        out, lse = _flash(q, k, v, 0.0, block.causal, attn_mask=block.mask, scale=scale)
        return out, lse.float()
    return _reference_forward(q, k, v, block, scale)


def _kernel_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        dq, dk, dv = _flash_backward(
            grad, q, k, v, out, lse, 0.0, block.causal, attn_mask=block.mask, scale=scale
        )
        return dq, dk, dv
    return _reference_backward(grad, q, k, v, out, lse, block, scale)


def _scores(q: torch.Tensor, k: torch.Tensor, block: Block, scale: float | None) -> torch.Tensor:
    """Scaled, masked scores in float32 (the accelerator path: plain torch ops)."""
    factor = scale if scale is not None else q.shape[-1] ** -0.5
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * factor
    if block.causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if block.mask is not None:
        s = s + block.mask.float()
    return s


def _reference_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, block, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def _reference_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    factor = scale if scale is not None else q.shape[-1] ** -0.5
    p = torch.exp(_scores(q, k, block, scale) - lse.unsqueeze(-1))
    g = grad.float()
    dv = torch.matmul(p.transpose(-1, -2), g)
    dp = torch.matmul(g, v.float().transpose(-1, -2))
    delta = (g * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * factor
    dq = torch.matmul(ds, k.float())
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    repeats = heads // kv.shape[1]
    return kv if repeats == 1 else kv.repeat_interleave(repeats, dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    repeats = grad.shape[1] // kv_heads
    if repeats == 1:
        return grad
    b, _, s, d = grad.shape
    return grad.view(b, kv_heads, repeats, s, d).sum(2)


@dataclass
class Running:
    """One query chunk's merged output (float32) and log-sum-exp so far."""

    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        if self.out is None or self.lse is None:
            self.out, self.lse = out.float(), lse
            return
        merged = torch.logaddexp(self.lse, lse)
        self.out = self.out * torch.exp(self.lse - merged).unsqueeze(-1) + out.float() * torch.exp(
            lse - merged
        ).unsqueeze(-1)
        self.lse = merged


class BlockAttention:
    """Attention of this rank's query chunks over key/value chunks that arrive in any
    order (all at once, or one rank's at a time around a ring)."""

    def __init__(self, masking: Masking, chunk: int, scale: float | None) -> None:
        self.masking = masking
        self.chunk = chunk
        self.scale = scale

    def blocks(
        self, q_chunks: Sequence[int], kv_chunks: Sequence[int], dtype: torch.dtype
    ) -> list[list[Block]]:
        """``[qi][ki]``: how query chunk ``qi`` sees key chunk ``ki``."""
        return [[self.masking.block(q, k, self.chunk, dtype) for k in kv_chunks] for q in q_chunks]

    def calls(
        self, q_chunks: Sequence[int], kv_chunks: Sequence[int], dtype: torch.dtype
    ) -> list[tuple[range, tuple[int, ...], Block]]:
        """The kernel calls covering every block that is not skipped: ``(query chunks,
        key chunks, block)``. Neighbouring query chunks that see the same key chunks whole
        go in one call with those keys together (fewer, larger kernel calls: under
        load-balanced causal attention each ring step is one or two calls); a causal or
        masked block is a call of its own."""
        grid = self.blocks(q_chunks, kv_chunks, dtype)
        found: list[tuple[range, tuple[int, ...], Block]] = []
        for qi, row in enumerate(grid):
            for ki, block in enumerate(row):
                if block.kind not in (SKIP, FULL):
                    found.append((range(qi, qi + 1), (ki,), block))
        whole = [tuple(ki for ki, b in enumerate(row) if b.kind == FULL) for row in grid]
        qi = 0
        while qi < len(grid):
            end = qi + 1
            while end < len(grid) and whole[end] == whole[qi]:
                end += 1
            if whole[qi]:
                found.append((range(qi, end), whole[qi], Block(FULL)))
            qi = end
        return found

    def _rows(self, t: torch.Tensor, chunks: range) -> torch.Tensor:
        return t.narrow(2, chunks.start * self.chunk, len(chunks) * self.chunk).contiguous()

    def _keys(self, t: torch.Tensor, chunks: tuple[int, ...]) -> torch.Tensor:
        if chunks == tuple(range(chunks[0], chunks[-1] + 1)):
            return t.narrow(2, chunks[0] * self.chunk, len(chunks) * self.chunk).contiguous()
        return torch.cat([t.narrow(2, k * self.chunk, self.chunk) for k in chunks], dim=2)

    def forward(
        self,
        running: list[Running],
        q: torch.Tensor,
        q_chunks: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        kv_chunks: Sequence[int],
    ) -> None:
        """Add the blocks of ``q`` (its chunks ``q_chunks``) against ``k``/``v`` (chunks
        ``kv_chunks``) to ``running``."""
        heads = q.shape[1]
        k, v = _expand(k, heads), _expand(v, heads)
        for rows, keys, block in self.calls(q_chunks, kv_chunks, q.dtype):
            out, lse = _kernel(
                self._rows(q, rows), self._keys(k, keys), self._keys(v, keys), block, self.scale
            )
            parts = zip(
                torch.split(out, self.chunk, dim=2),
                torch.split(lse, self.chunk, dim=2),
                strict=True,
            )
            for qi, (o, m) in zip(rows, parts, strict=True):
                running[qi].add(o, m)

    def backward(
        self,
        grad_q: list[torch.Tensor],
        grad_out: list[torch.Tensor],
        q: torch.Tensor,
        q_chunks: Sequence[int],
        out: list[torch.Tensor],
        lse: list[torch.Tensor],
        k: torch.Tensor,
        v: torch.Tensor,
        kv_chunks: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the blocks' query gradients to ``grad_q`` (per query chunk) and return the
        key and value gradients of ``k`` and ``v`` (their shapes)."""
        heads, kv_heads = q.shape[1], k.shape[1]
        k, v = _expand(k, heads), _expand(v, heads)
        dk_all, dv_all = torch.zeros_like(k), torch.zeros_like(v)
        for rows, keys, block in self.calls(q_chunks, kv_chunks, q.dtype):
            picked = list(rows)
            dq, dk, dv = _kernel_backward(
                torch.cat([grad_out[i] for i in picked], dim=2),
                self._rows(q, rows),
                self._keys(k, keys),
                self._keys(v, keys),
                torch.cat([out[i] for i in picked], dim=2),
                torch.cat([lse[i] for i in picked], dim=2),
                block,
                self.scale,
            )
            for qi, part in zip(rows, torch.split(dq, self.chunk, dim=2), strict=True):
                grad_q[qi] += part
            for ki, dk_part, dv_part in zip(
                keys,
                torch.split(dk, self.chunk, dim=2),
                torch.split(dv, self.chunk, dim=2),
                strict=True,
            ):
                dk_all.narrow(2, ki * self.chunk, self.chunk).add_(dk_part)
                dv_all.narrow(2, ki * self.chunk, self.chunk).add_(dv_part)
        return _fold(dk_all, kv_heads), _fold(dv_all, kv_heads)


def finish(
    running: list[Running], dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The merged output (``dtype``, chunks concatenated), and per chunk the output and
    log-sum-exp the backward reads."""
    outs = [r.out.to(dtype) for r in running if r.out is not None]
    lses = [r.lse for r in running if r.lse is not None]
    if len(outs) != len(running):
        raise RuntimeError("context-parallel attention: a query chunk saw no key; fix masks.py")
    return torch.cat(outs, dim=2), [o.contiguous() for o in outs], lses
