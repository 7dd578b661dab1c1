"""Small models for the engine tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        out: torch.Tensor = self.layers[-1](x)
        return out


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    """Decoder-only transformer with a tied lm head."""

    def __init__(
        self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 16
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.mid = nn.Linear(16, 16)
        self.unembed = nn.Linear(16, 20, bias=False)
        self.unembed.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.unembed(torch.tanh(self.mid(self.embed(idx))))
        return out


class WithUnused(MLP):
    def __init__(self) -> None:
        super().__init__(width=16, depth=3)
        self.never = nn.Linear(16, 16)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def batch(name: str, step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input, target) for model ``name`` at ``step`` on ``rank``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    if name in ("gpt", "tied"):
        vocab = 64 if name == "gpt" else 20
        idx = torch.randint(0, vocab, (size, 16 if name == "gpt" else 6), generator=gen)
        return idx, torch.roll(idx, -1, dims=1)
    width = {"mlp": 32, "unused": 16, "batchnorm": 8}[name]
    return torch.randn(size, width, generator=gen), torch.randn(size, width, generator=gen)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {
        "mlp": MLP,
        "gpt": TinyGPT,
        "tied": Tied,
        "unused": WithUnused,
        "batchnorm": WithBatchNorm,
    }[name]()


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name in ("gpt", "tied"):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)
