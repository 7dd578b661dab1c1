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

from lamina.strategies.cp.masks import SKIP, Block, Masking

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

    def _split(self, t: torch.Tensor, parts: int) -> list[torch.Tensor]:
        return [c.contiguous() for c in torch.split(t, self.chunk, dim=2)][:parts]

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
        qs = self._split(q, len(q_chunks))
        ks = self._split(_expand(k, heads), len(kv_chunks))
        vs = self._split(_expand(v, heads), len(kv_chunks))
        for qi, row in enumerate(self.blocks(q_chunks, kv_chunks, q.dtype)):
            for ki, block in enumerate(row):
                if block.kind != SKIP:
                    running[qi].add(*_kernel(qs[qi], ks[ki], vs[ki], block, self.scale))

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
        qs = self._split(q, len(q_chunks))
        ks = self._split(_expand(k, heads), len(kv_chunks))
        vs = self._split(_expand(v, heads), len(kv_chunks))
        dks = [torch.zeros_like(c) for c in ks]
        dvs = [torch.zeros_like(c) for c in vs]
        for qi, row in enumerate(self.blocks(q_chunks, kv_chunks, q.dtype)):
            for ki, block in enumerate(row):
                if block.kind == SKIP:
                    continue
                dq, dk, dv = _kernel_backward(
                    grad_out[qi], qs[qi], ks[ki], vs[ki], out[qi], lse[qi], block, self.scale
                )
                grad_q[qi] += dq
                dks[ki] += dk
                dvs[ki] += dv
        return _fold(torch.cat(dks, dim=2), kv_heads), _fold(torch.cat(dvs, dim=2), kv_heads)


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
