"""What ``"auto"`` reads of the model's attention: :func:`attention_profile`.

One forward without gradients on the example inputs, watching every
``torch.nn.functional.scaled_dot_product_attention`` call (a transformers attention
interface built on it included): its batch, query and key/value heads, tokens, head dim,
element size and whether it is causal; and the bytes of the forward's outputs that have
the sequence on ``seq_dim`` (what context parallelism gathers back). Context parallelism
is priced from these (:mod:`lamina.auto.predict`) and considered only for a sequence of
at least ``context_min_tokens`` (:mod:`lamina.auto.choose`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lamina.strategies.cp.calls import SDPA, attention_call


@dataclass(frozen=True)
class AttentionCall:
    """One self-attention call of the forward, at the example inputs' shape."""

    batch: int
    heads: int
    kv_heads: int
    tokens: int
    head_dim: int
    itemsize: int
    causal: bool

    @property
    def kv_bytes(self) -> int:
        """Bytes of the call's keys and values over the whole sequence."""
        return 2 * self.batch * self.kv_heads * self.tokens * self.head_dim * self.itemsize


@dataclass(frozen=True)
class AttentionProfile:
    """The forward's attention calls and sequence-long outputs, read on ``rows`` rows."""

    rows: int
    calls: tuple[AttentionCall, ...]
    #: Bytes of the outputs with the sequence on ``seq_dim``, on ``rows`` rows.
    output_bytes: int

    @property
    def tokens(self) -> int:
        """The longest sequence an attention call sees (0: none)."""
        return max((c.tokens for c in self.calls), default=0)

    def to_json(self) -> dict[str, Any]:
        """Plain data."""
        return {
            "rows": self.rows,
            "tokens": self.tokens,
            "calls": len(self.calls),
            "kv_bytes": sum(c.kv_bytes for c in self.calls),
            "output_bytes": self.output_bytes,
        }


class _Watching(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is SDPA:
            call = attention_call(args, kwargs)
            q, k = call.query, call.key
            if q.dim() == 4 and k.dim() == 4 and k.shape[-2] == q.shape[-2]:
                self.calls.append(
                    AttentionCall(
                        batch=int(q.shape[0]),
                        heads=int(q.shape[1]),
                        kv_heads=int(k.shape[1]),
                        tokens=int(q.shape[-2]),
                        head_dim=int(q.shape[-1]),
                        itemsize=q.element_size(),
                        causal=bool(call.is_causal),
                    )
                )
        return func(*args, **kwargs)


def attention_profile(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    rows: int,
    seq_dim: int = 1,
) -> AttentionProfile | None:
    """The attention calls of one forward of ``model`` on ``inputs`` (``rows`` rows);
    None when it makes none (see the module)."""
    watching = _Watching()
    with torch.no_grad(), watching:
        out = model(*inputs, **(kwargs or {}))
    if not watching.calls:
        return None
    tokens = max(c.tokens for c in watching.calls)
    output_bytes = sum(
        t.numel() * t.element_size()
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.dim() > seq_dim and t.shape[seq_dim] == tokens
    )
    return AttentionProfile(rows, tuple(watching.calls), output_bytes)


__all__ = ["AttentionCall", "AttentionProfile", "attention_profile"]
