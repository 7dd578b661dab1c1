"""Models in the styles people train today, written here for the tp and pp tests.

- :class:`FusedLlama`: a Llama-3 as reference trainers write it: blocks in an
  ``nn.ModuleDict`` (keys ``"0"``.. so pipeline cuts keep parameter names), one fused
  ``wqkv`` projection split with its sizes written in the code (grouped-query attention:
  more query heads than key/value heads), rotary embeddings applied as a complex
  multiply (``view_as_complex``), ``nn.RMSNorm`` (``F.rms_norm``), optionally per-head
  q/k norms, a SwiGLU feed-forward;
- :func:`qwen3` and :func:`qwen3_moe`: transformers' Qwen3 (per-head q/k RMSNorm) and
  Qwen3-MoE built from small configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64


@dataclass(frozen=True)
class LlamaArgs:
    """The fused Llama's sizes."""

    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = VOCAB
    hidden: int = 128
    max_seq: int = 64
    theta: float = 500000.0
    qk_norm: bool = False


def rotary_table(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """Complex rotations ``(length, head_dim / 2)``: position times each pair's frequency."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


class Rotary(nn.Module):
    """Rotary embedding as a complex multiply over each head's pairs."""

    def forward(
        self, xq: torch.Tensor, xk: torch.Tensor, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        rot = table[: q.shape[1]].view(1, q.shape[1], 1, q.shape[-1])
        q_out = torch.view_as_real(q * rot).flatten(3)
        k_out = torch.view_as_real(k * rot).flatten(3)
        return q_out.type_as(xq), k_out.type_as(xk)


class FusedAttention(nn.Module):
    """Grouped-query attention with one fused q/k/v projection."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.heads, self.kv_heads = args.heads, args.kv_heads
        self.head_dim = args.dim // args.heads
        sizes = (args.heads + 2 * args.kv_heads) * self.head_dim
        self.wqkv = nn.Linear(args.dim, sizes, bias=False)
        self.wo = nn.Linear(args.heads * self.head_dim, args.dim, bias=False)
        self.rope = Rotary()
        self.q_norm = nn.RMSNorm(self.head_dim, eps=1e-6) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=1e-6) if args.qk_norm else None

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        xq, xk, xv = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        xq = xq.view(bs, seq, -1, self.head_dim)
        xk = xk.view(bs, seq, -1, self.head_dim)
        xv = xv.view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = self.rope(xq, xk, table)
        repeats = self.heads // self.kv_heads
        xk = xk.repeat_interleave(repeats, dim=2)
        xv = xv.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden, bias=False)
        self.w2 = nn.Linear(args.hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm attention and feed-forward, each added back."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.attention = FusedAttention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class FusedLlama(nn.Module):
    """The fused Llama (see the module): token ids in, logits out."""

    def __init__(self, args: LlamaArgs | None = None) -> None:
        super().__init__()
        args = args or LlamaArgs()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab, args.dim)
        self.register_buffer(
            "rotations", rotary_table(args.dim // args.heads, args.max_seq, args.theta), False
        )
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.layers)})
        self.norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rotations)
        return self.output(self.norm(h))


def fused_llama(seed: int = 0, **sizes: object) -> FusedLlama:
    """A :class:`FusedLlama` with seeded weights (``sizes`` override :class:`LlamaArgs`)."""
    torch.manual_seed(seed)
    return FusedLlama(LlamaArgs(**sizes))  # type: ignore[arg-type]


def qwen3(seed: int = 0, layers: int = 2) -> nn.Module:
    """transformers' Qwen3 (per-head q/k RMSNorm), small, float32, sdpa attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config)


def qwen3_moe(
    seed: int = 0, layers: int = 2, experts: int = 4, router_loss: bool = False
) -> nn.Module:
    """transformers' Qwen3-MoE (q/k norms, ``experts`` experts, top-2), small, float32;
    ``router_loss``: its load-balancing loss added to the loss."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=experts,
        num_experts_per_tok=2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        output_router_logits=router_loss,
        router_aux_loss_coef=0.1,
    )
    return Qwen3MoeForCausalLM(config)


def mixtral(
    seed: int = 0, layers: int = 2, experts: int = 8, router_loss: bool = False
) -> nn.Module:
    """transformers' Mixtral (``experts`` experts, top-2), small, float32; ``router_loss``:
    its load-balancing loss added to the loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        output_router_logits=router_loss,
        router_aux_loss_coef=0.1,
    )
    return MixtralForCausalLM(config)
