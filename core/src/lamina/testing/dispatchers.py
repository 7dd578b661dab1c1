"""Checking an MoE token dispatcher against the whole layer in one process:
:func:`check_dispatcher`.

For a plugin author shipping a :class:`~lamina.strategies.ep.dispatch.Dispatcher`: run
:func:`check_dispatcher` on every rank of a job (after ``lamina.init()``), or
:func:`check_dispatcher_on_ranks` from a test, which starts the ranks. The layer has
:data:`EXPERTS` experts of the transformers 5 stacked layout spread over all ranks, top-2
routing as Mixtral's router does it, and each rank its own tokens (a number per rank,
zero allowed). Each rank's output, its tokens' and router's gradients, and its experts'
gradients (from every rank's tokens) must equal the whole layer's on all the tokens in
one process within ``tolerance``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lamina.strategies.ep.dispatch import Dispatcher, ExpertGroup
from lamina.strategies.ep.experts import StackedExperts
from lamina.strategies.ep.registry import resolve_dispatcher

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 16, 24
#: Tokens of ranks 0, 1, 2, ... (cycled): uneven on purpose.
TOKENS = (10, 7, 12, 9)


@dataclass(frozen=True)
class DispatchCheck:
    """One rank's result: the largest difference of each compared tensor, and the
    exchanges the dispatcher announced, in order: (node, op, in backward)."""

    errors: dict[str, float]
    issued: list[tuple[str, str, bool]] = field(default_factory=list)

    def failures(self, tolerance: float) -> list[str]:
        """What differs by more than ``tolerance``, one line each."""
        return [f"{what} differs by {e:.3g}" for what, e in self.errors.items() if e > tolerance]


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    router = torch.randn(EXPERTS, HIDDEN, generator=g)
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE**0.5
    return router, gate_up, down


def _tokens(rank: int, counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    n = counts[rank % len(counts)]
    return torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g)


def _route(hidden: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router: softmax, top-k, the k weights renormalised."""
    probs = F.softmax(F.linear(hidden, router).float(), dim=-1)
    weights, index = torch.topk(probs, TOP_K, dim=-1)
    return index, weights / weights.sum(dim=-1, keepdim=True)


def whole_layer(
    hidden: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The layer in one process, as transformers' Mixtral experts compute it."""
    index, weights = _route(hidden, router)
    out = torch.zeros_like(hidden)
    for e in range(gate_up.shape[0]):
        slot, token = torch.where((index == e).t())
        gate, up = F.linear(hidden[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out = out.index_add(0, token, y)
    return out


def _largest(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return (a - b).abs().max().item() if a.numel() else 0.0


def check_dispatcher(
    dispatcher: Dispatcher | str, counts: tuple[int, ...] = TOKENS
) -> DispatchCheck:
    """``dispatcher`` (or its name) on this job's ranks against the whole layer (see the
    module; collective: every rank of the default group)."""
    chosen = resolve_dispatcher(dispatcher)
    rank, world = dist.get_rank(), dist.get_world_size()
    router, gate_up, down = _weights()
    ep = ExpertGroup(None, world, rank, EXPERTS)
    issued: list[tuple[str, str, bool]] = []

    @contextmanager
    def issuing(node: str, op: str, _nbytes: int, backward: bool) -> Iterator[None]:
        issued.append((node, op, backward))
        yield

    experts = StackedExperts(gate_up, down, ep.first, ep.local)
    my_router = router.clone().requires_grad_()
    hidden, upstream = _tokens(rank, counts)
    hidden.requires_grad_()
    index, weights = _route(hidden, my_router)
    out = chosen.dispatch(ep, hidden, index, weights, experts, 0, issuing)
    (out * upstream).sum().backward()  # type: ignore[no-untyped-call]

    ref_router = router.clone().requires_grad_()
    ref_gate_up, ref_down = gate_up.clone().requires_grad_(), down.clone().requires_grad_()
    total = torch.zeros(())
    mine_out, mine_hidden = torch.zeros(0), torch.zeros(0)
    for r in range(world):
        h, u = _tokens(r, counts)
        h.requires_grad_()
        ref = whole_layer(h, ref_router if r == rank else router, ref_gate_up, ref_down)
        total = total + (ref * u).sum()
        if r == rank:
            mine_out, mine_hidden = ref, h
    total.backward()  # type: ignore[no-untyped-call]
    local = slice(ep.first, ep.first + ep.local)
    assert ref_gate_up.grad is not None and ref_down.grad is not None
    errors = {
        "output": _largest(out.detach(), mine_out.detach()),
        "token gradient": _largest(hidden.grad, mine_hidden.grad),
        "router gradient": _largest(my_router.grad, ref_router.grad),
        "gate_up_proj gradient": _largest(experts.gate_up_proj.grad, ref_gate_up.grad[local]),
        "down_proj gradient": _largest(experts.down_proj.grad, ref_down.grad[local]),
    }
    return DispatchCheck(errors, issued)


def _on_rank(name: str, counts: tuple[int, ...]) -> DispatchCheck:
    import lamina

    lamina.init()
    try:
        return check_dispatcher(name, counts)
    finally:
        lamina.shutdown()


def check_dispatcher_on_ranks(
    name: str, world_size: int = 4, counts: tuple[int, ...] = TOKENS, tolerance: float = 1e-5
) -> list[DispatchCheck]:
    """:func:`check_dispatcher` of the dispatcher registered as ``name`` on
    ``world_size`` spawned gloo ranks; AssertionError naming each rank's differences."""
    from lamina.testing.harness import run_ranks

    results: list[DispatchCheck] = run_ranks(_on_rank, world_size, args=(name, counts))
    wrong = [f"rank {r}: {'; '.join(c.failures(tolerance))}" for r, c in enumerate(results)]
    wrong = [w for w, c in zip(wrong, results, strict=True) if c.failures(tolerance)]
    if wrong:
        raise AssertionError(
            f"dispatcher {name!r} differs from the whole layer in one process: " + " | ".join(wrong)
        )
    return results


__all__ = [
    "EXPERTS",
    "TOKENS",
    "DispatchCheck",
    "check_dispatcher",
    "check_dispatcher_on_ranks",
    "whole_layer",
]
