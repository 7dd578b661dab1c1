"""Small models for the engine tests (importable by spawned ranks)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import checkpoint

# the GPT the examples train (examples/ is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig
from _gpt_model import Block as Block  # the examples' transformer block, for the tests


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


def tiny_llama(seed: int = 0, **config: object) -> nn.Module:
    """A Hugging Face Llama (grouped-query attention: 4 heads, 2 key/value heads) at a
    test size, initialized from ``seed``; ``config`` overrides ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings: dict[str, object] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        **config,
    }
    model: nn.Module = LlamaForCausalLM(LlamaConfig(**settings))
    return model


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


class OddSized(nn.Module):
    """Sizes that never divide evenly (35 + 5 + 15 + 3 elements): every shard is padded."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.tanh(self.a(x)))
        return out


class KitchenSink(nn.Module):
    """Everything a real model does that sharding must get right, at sizes that never
    divide by 2 or 3 (vocab 19, width 13): an embedding tied to the head, a block called
    twice (``blocks.0``), a block holding a frozen layer (``blocks.1.1``), a block never
    called (``blocks.2``) and a root layer never called (``never``), a BatchNorm, and a
    forward keyword argument (``temperature``) that changes the output. ``checkpointed``
    recomputes each block call in backward (``torch.utils.checkpoint``, non-reentrant);
    ``batchnorm=False`` drops the BatchNorm (whose fp32 running statistics torch's CPU
    kernel does not mix with bf16 weights, sharded or not)."""

    def __init__(
        self,
        vocab: int = 19,
        width: int = 13,
        checkpointed: bool = False,
        batchnorm: bool = True,
    ) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.embed = nn.Embedding(vocab, width)
        frozen = nn.Linear(width, width).requires_grad_(False)
        self.blocks = nn.ModuleList(
            [
                nn.Linear(width, width),
                nn.Sequential(nn.Linear(width, width), frozen),
                nn.Linear(width, width),
            ]
        )
        self.never = nn.Linear(width, width)
        self.norm: nn.Module = nn.BatchNorm1d(width) if batchnorm else nn.Identity()
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def _block(self, k: int, h: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            out: torch.Tensor = checkpoint(self.blocks[k], h, use_reentrant=False)
            return out
        out = self.blocks[k](h)
        return out

    def forward(self, idx: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        h = torch.tanh(self._block(0, self.embed(idx)))
        h = torch.tanh(self._block(0, h))  # the same block again
        h = torch.tanh(self._block(1, h))
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        out: torch.Tensor = self.head(h) / temperature
        return out


def batch(name: str, step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input, target) for model ``name`` at ``step`` on ``rank``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    if name in ("gpt", "tied"):
        vocab = 64 if name == "gpt" else 20
        idx = torch.randint(0, vocab, (size, 16 if name == "gpt" else 6), generator=gen)
        return idx, torch.roll(idx, -1, dims=1)
    if name.startswith("sink"):
        idx = torch.randint(0, 19, (size, 5), generator=gen)
        return idx, torch.roll(idx, -1, dims=1)
    if name == "odd":
        return torch.randn(size, 7, generator=gen), torch.randn(size, 3, generator=gen)
    width = {"mlp": 32, "unused": 16, "batchnorm": 8}[name]
    return torch.randn(size, width, generator=gen), torch.randn(size, width, generator=gen)


def build(name: str, seed: int = 0) -> nn.Module:
    """Model ``name`` initialized from ``seed``.

    Equivalence tests on several ranks pass ``seed=rank``: the ranks then start from
    different weights, and only the wrappers' wrap-time broadcast of rank 0's state makes
    them agree, so a test comparing with torch DDP fails when that broadcast is missing.
    """
    torch.manual_seed(seed)
    return {
        "mlp": MLP,
        "gpt": tiny_gpt,
        "tied": Tied,
        "unused": WithUnused,
        "batchnorm": WithBatchNorm,
        "odd": OddSized,
        "sink": KitchenSink,
        "sink-checkpointed": lambda: KitchenSink(checkpointed=True),
        "sink-without-batchnorm": lambda: KitchenSink(batchnorm=False),
    }[name]()


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name in ("gpt", "tied") or name.startswith("sink"):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)


def differs_from_rank0(name: str, model: nn.Module) -> bool:
    """Whether ``model`` holds other weights than ``build(name, seed=0)`` (rank 0's): the
    check that a rank-dependent start really starts apart."""
    rank0 = build(name, seed=0).parameters()
    return any(not torch.equal(a, b) for a, b in zip(model.parameters(), rank0, strict=True))


def _grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient; zeros when it has none (a parameter the forward did not use,
    which torch DDP may leave without a gradient)."""
    return param.grad.detach() if param.grad is not None else torch.zeros_like(param)


def grad_diff(ours: Iterable[torch.Tensor], reference: Iterable[torch.Tensor]) -> float:
    """Largest gradient difference between two models' parameters (in the same order),
    relative to the reference's largest gradient: a wrongly scaled average (forgetting to
    divide by the world size, or dividing twice) gives 0.5 or more."""
    diff, scale = 0.0, 0.0
    for a, b in zip(ours, reference, strict=True):
        ga, gb = _grad_or_zeros(a).float(), _grad_or_zeros(b).float()
        diff = max(diff, (ga - gb).abs().max().item())
        scale = max(scale, gb.abs().max().item())
    return diff / max(scale, 1e-12)


def full_params(sharded: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a ZeRO-3/HSDP model, gathered whole (``DTensor.full_tensor``:
    collective, every rank calls it), under its own name."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in sharded.named_parameters()
    }


def shard_grad_diff(sharded: nn.Module, reference: nn.Module, rank: int = 0) -> float:
    """Like :func:`grad_diff` for a ZeRO-3/HSDP model: each parameter's gradient, gathered
    whole from its shards, against ``reference``'s (same names). A parameter without a
    gradient counts as zeros on either side. Collective: every rank calls it."""
    named = dict(reference.named_parameters())
    diff, scale = 0.0, 0.0
    for name, param in sharded.named_parameters():
        grad = param.grad
        got = grad.full_tensor() if isinstance(grad, DTensor) else grad
        want = _grad_or_zeros(named[name]).float()
        got = got.detach().float() if got is not None else torch.zeros_like(want)
        diff = max(diff, (got - want).abs().max().item())
        scale = max(scale, want.abs().max().item())
    return diff / max(scale, 1e-12)


def relative_grad_l2(ours: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """``||g - g_ref|| / ||g_ref||`` over every parameter of ``ours`` against ``reference``
    (whole gradients by parameter name); a missing gradient counts as zeros. A sharded
    gradient is compared shard by shard against the rows it holds and the sums taken over
    the ranks (one all-reduce: every rank calls it; HSDP's replicas count each shard
    once per replica, on both sides). A mean off by a factor (divided twice, summed twice)
    is off by 0.5 or more."""
    sums = torch.zeros(2, dtype=torch.float64)
    sharded = False
    for name, param in ours.named_parameters():
        want = reference[name].detach().float()
        grad = param.grad
        if isinstance(param, DTensor):
            sharded = True
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            want = want[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
            grad = grad.to_local() if isinstance(grad, DTensor) else grad
        got = grad.detach().float() if grad is not None else torch.zeros_like(want)
        sums += torch.stack([(got - want).pow(2).sum(), want.pow(2).sum()]).double()
    if sharded:
        dist.all_reduce(sums)
    return float(sums[0].sqrt() / sums[1].sqrt().clamp_min(1e-30))


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


class _Expert(nn.Module):
    """One Mixtral-style expert: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class _SparseMoE(nn.Module):
    """A Mixtral-style block: a router picks the top 2 of the experts for each token and
    mixes their outputs by the renormalized router weights (every expert runs densely on
    every token, the unpicked ones weighted 0, so the forward has no data-dependent
    shapes)."""

    def __init__(self, width: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(_Expert(width, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1)
        top, picked = torch.topk(probs, 2, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, picked, top / top.sum(-1, keepdim=True))
        out: torch.Tensor | None = None
        for k, expert in enumerate(self.experts):
            part = weights[..., k : k + 1] * expert(x)
            out = part if out is None else out + part
        assert out is not None
        return out


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = nn.Linear(width, width, bias=False)
        self.head_dim = width // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected


class _MoEBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(width)
        self.attn = _Attention(width, heads)
        self.norm2 = nn.RMSNorm(width)
        self.moe = _SparseMoE(width, hidden, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.moe(self.norm2(x))
        return out


class TinyMoE(nn.Module):
    """A decoder of Mixtral-style sparse MoE blocks (4 experts, top 2) at a test size."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_MoEBlock(width, 4, 2 * width, 4) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits
