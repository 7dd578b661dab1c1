"""Small models for the engine tests (importable by spawned ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# the GPT the examples train (examples/ is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        out: torch.Tensor = self.layers[-1](x)
        return out


def tiny_gpt() -> nn.Module:
    """The examples' GPT (tied lm head) at a test size."""
    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))


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
        "gpt": tiny_gpt,
        "tied": Tied,
        "unused": WithUnused,
        "batchnorm": WithBatchNorm,
    }[name]()


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name in ("gpt", "tied"):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)


@torch.fx.wrap
def sign_flip(x: torch.Tensor) -> torch.Tensor:
    """A data-dependent branch: fx keeps it as one opaque call, export must guard on it."""
    if x.sum() > 0:
        return x
    return -x


class NeedsFx(nn.Module):
    """torch.export fails on the data-dependent branch; fx traces around it."""

    def __init__(self, d_in: int = 4, hidden: int = 4, d_out: int = 2) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(sign_flip(self.a(x)))
        return out


class NeedsHooks(nn.Module):
    """Python control flow on a tensor value right in forward (export and fx both fail);
    ``a`` is called twice."""

    def __init__(self, width: int = 4, d_out: int = 2) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = torch.relu(h)
        out: torch.Tensor = self.b(self.a(h))
        return out
