"""What expert parallelism measures on the job before it plans: :func:`measure_on_job`.

- **Compute**: a rank's forward and backward of the whole model on its own example
  batch, every rank at once (so each runs at its share of the machine, as in the step),
  the slowest rank's time, median of eight after one warm-up. Each MoE layer runs as the
  dispatch does, without moving a token: its assignments counted and the counts
  exchanged, then a rank's share of the experts computing as many rows as the routing
  sends them (so the busiest rank computes the most, as in the step), one expert at a
  time, and the results combined back, with a one-element all-reduce over
  the ep group where the step exchanges (forward and backward), so each rank waits for
  the others there as it will. This is the ep step's compute without its exchanges'
  bytes; the simulator adds those (:mod:`lamina.simulate.expert`).
- **Routing**: the assignments each rank's example batch routed to each expert, per MoE
  layer, gathered over the ep group; the mean rank's exchange with the other ranks
  (:func:`mean_exchange`), the largest over the ep groups, sizes the plan's token
  all-to-alls on every rank (a link shared by several ranks carries their sum; the
  busiest rank's extra work is in the compute, where the others wait for it).

Collective over the whole job (barriers, maxima) and the ep group (the gather); the
gradients the timed backward leaves are dropped and the ones before it restored.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from lamina.strategies.ep.experts import grouped_experts
from lamina.strategies.ep.find import MoeLayer

#: Timed steps (the first warms up).
TIMED_STEPS = 9


@dataclass(frozen=True)
class ExpertMeasured:
    """The MoE layers, the local step's seconds, and per layer the assignments a rank of
    the busiest ep group sends to the other ranks on average."""

    layers: tuple[MoeLayer, ...]
    step_s: float
    exchanged: tuple[int, ...]


def measure_on_job(
    model: nn.Module,
    run: Callable[[], Any],
    layers: tuple[MoeLayer, ...],
    group: dist.ProcessGroup | None,
    size: int,
    sync: Callable[[], None],
) -> ExpertMeasured:
    """See the module: ``run`` calls the forward on the example batch, ``sync`` waits for
    the device."""
    params = [p for p in model.parameters() if p.requires_grad]
    held = [p.grad for p in params]
    times = []
    with _dispatched_in_place(model, layers, size, group if size > 1 else None):
        for _ in range(TIMED_STEPS):
            dist.barrier()
            start = time.perf_counter()
            _scalar(run()).backward()  # type: ignore[no-untyped-call]
            sync()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(float(took.item()))
            for p in params:
                p.grad = None
    for p, grad in zip(params, held, strict=True):
        p.grad = grad
    device = next((p.device for p in params), torch.device("cpu"))
    mine = torch.tensor([list(layer.routed) for layer in layers], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    if size > 1:
        dist.all_gather(everyone, mine, group=group)
    else:
        everyone = [mine]
    routed = [rank.cpu().tolist() for rank in everyone]
    exchanged = torch.tensor(
        [mean_exchange(tuple(tuple(rank[i]) for rank in routed)) for i in range(len(layers))],
        dtype=torch.int64,
        device=device,
    )
    # the busiest ep group's, so that every rank plans the same exchanges
    dist.all_reduce(exchanged, op=dist.ReduceOp.MAX)
    return ExpertMeasured(
        layers, statistics.median(times[1:]), tuple(int(b) for b in exchanged.tolist())
    )


class _Exchanged(torch.autograd.Function):
    """Where the step exchanges: a one-element all-reduce over the ep group, forward and
    backward (each rank waits for the others there)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        _meet(x, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _meet(grad, ctx.group)
        return grad, None


def _meet(like: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(torch.zeros(1, device=like.device), group=group)


@contextmanager
def _dispatched_in_place(
    model: nn.Module, layers: tuple[MoeLayer, ...], size: int, group: dist.ProcessGroup | None
) -> Iterator[None]:
    """Inside the block, each MoE layer's experts run as the dispatch runs them, on this
    rank with ``1 / size`` of them (see the module)."""
    modules = [model.get_submodule(layer.name) for layer in layers]
    for module in modules:
        module.forward = _local_dispatch(module, size, group)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def _local_dispatch(
    module: nn.Module, size: int, group: dist.ProcessGroup | None
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The experts' forward as one ep rank computes it, without moving a token: the
    assignment counts exchanged as the step exchanges them, then ``1 / size`` of the
    experts (a copy of this rank's, so that weights and their gradients are the size a
    rank holds) computing as many rows as the routing sends them (this rank's own
    assignments, repeated to that count: the busiest rank computes the most, as in the
    step), and this rank's assignments' results combined back."""
    whole_up, whole_down = module.gate_up_proj, module.down_proj
    act = getattr(module, "act_fn", F.silu)
    assert isinstance(whole_up, torch.Tensor) and isinstance(whole_down, torch.Tensor)
    experts = whole_up.shape[0]
    local = max(1, experts // size)
    index = dist.get_group_rank(group, dist.get_rank()) if group is not None else 0
    first = index * local
    gate_up = whole_up[first : first + local].detach().clone()
    down = whole_down[first : first + local].detach().clone()
    gate_up.requires_grad_(whole_up.requires_grad)
    down.requires_grad_(whole_down.requires_grad)

    def forward(
        hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // top_k_index.shape[1]
        counts = torch.bincount(flat, minlength=experts)
        received = counts.clone()
        if group is not None:
            dist.all_to_all_single(received, counts, group=group)
        per_local = received.reshape(size, local).sum(0).tolist()
        rows = sum(per_local)
        mine = _Exchanged.apply(hidden[token_of], group)  # type: ignore[no-untyped-call]
        if rows == 0 or mine.shape[0] == 0:
            results = mine.new_zeros(mine.shape)
        else:
            take = torch.arange(rows, device=mine.device) % mine.shape[0]
            computed = grouped_experts(gate_up, down, act, mine[take], per_local)
            back = torch.arange(mine.shape[0], device=mine.device) % rows
            results = _Exchanged.apply(computed, group)[back]  # type: ignore[no-untyped-call]
        weights = top_k_weights.reshape(-1)[order].to(results.dtype)
        combined = torch.zeros_like(hidden, dtype=results.dtype)
        combined = combined.index_add(0, token_of, results * weights[:, None])
        return combined.to(hidden.dtype)

    return forward


def mean_exchange(routed: tuple[tuple[int, ...], ...]) -> int:
    """Assignments a rank of the group sends to the other ranks in one layer's token
    exchange, on average (rounded up), from each rank's per-expert counts (experts held
    in equal consecutive slices)."""
    size = len(routed)
    local = len(routed[0]) // size
    off_rank = sum(
        c for rank in range(size) for e, c in enumerate(routed[rank]) if e // local != rank
    )
    return -(-off_rank // size)


def _scalar(out: Any) -> torch.Tensor:
    """One number whose backward reaches every output (a transformers output's logits
    and load-balancing loss; else every floating tensor leaf)."""
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        total = logits.float().sum()
        aux = getattr(out, "aux_loss", None)
        return total + aux if isinstance(aux, torch.Tensor) else total
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return sum((t.float().sum() for t in leaves), torch.zeros(()))


__all__ = ["ExpertMeasured", "mean_exchange", "measure_on_job"]
