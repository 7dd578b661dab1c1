"""Expert parallelism's dropless dispatch (``lamina.strategies.ep``): on 4 gloo ranks,
an MoE layer of 8 experts (2 a rank, the transformers 5 stacked layout) with top-2
routing, against the whole layer in one process on the same tokens: each rank's output,
its tokens' and router's gradients, and its experts' gradients (from every rank's
tokens) equal; every exchange announced in order, forward and backward; a rank with no
token, and an expert no token chose, take part without a hang."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import lamina
from lamina.errors import ConfigError
from lamina.strategies.ep import AllToAllDispatcher, ExpertGroup, StackedExperts
from lamina.testing import run_ranks

pytestmark = [pytest.mark.multiprocess]

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 16, 24


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    router = torch.randn(EXPERTS, HIDDEN, generator=g)
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE**0.5
    return router, gate_up, down


def _tokens(rank: int, counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(counts[rank], HIDDEN, generator=g), torch.randn(
        counts[rank], HIDDEN, generator=g
    )


def _route(hidden: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router: softmax, top-k, the k weights renormalised."""
    probs = F.softmax(F.linear(hidden, router).float(), dim=-1)
    weights, index = torch.topk(probs, TOP_K, dim=-1)
    return index, weights / weights.sum(dim=-1, keepdim=True)


def _whole_layer(
    hidden: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The layer in one process, as transformers' Mixtral experts compute it."""
    index, weights = _route(hidden, router)
    out = torch.zeros_like(hidden)
    for e in range(EXPERTS):
        slot, token = torch.where((index == e).t())
        gate, up = F.linear(hidden[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out = out.index_add(0, token, y)
    return out


def _job(counts: tuple[int, ...]) -> dict[str, Any]:
    runtime = lamina.init()
    rank, world = runtime.rank, runtime.world_size
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
    out = AllToAllDispatcher(ep, issuing).dispatch(hidden, index, weights, experts, layer=3)
    (out * upstream).sum().backward()

    # one process: every rank's tokens through the whole layer
    ref_router = router.clone().requires_grad_()
    ref_gate_up, ref_down = gate_up.clone().requires_grad_(), down.clone().requires_grad_()
    total = torch.zeros(())
    mine: dict[str, torch.Tensor] = {}
    for r in range(world):
        h, u = _tokens(r, counts)
        h.requires_grad_()
        ref = _whole_layer(h, ref_router if r == rank else router, ref_gate_up, ref_down)
        total = total + (ref * u).sum()
        if r == rank:
            mine = {"out": ref, "hidden": h}
    total.backward()
    local = slice(ep.first, ep.first + ep.local)
    assert ref_gate_up.grad is not None and ref_down.grad is not None
    errors = {
        "out": (out - mine["out"]).abs().max().item() if out.numel() else 0.0,
        "hidden_grad": (hidden.grad - mine["hidden"].grad).abs().max().item()  # type: ignore[operator]
        if out.numel()
        else 0.0,
        "router_grad": (my_router.grad - ref_router.grad).abs().max().item(),  # type: ignore[operator]
        "gate_up_grad": (experts.gate_up_proj.grad - ref_gate_up.grad[local]).abs().max().item(),  # type: ignore[operator]
        "down_grad": (experts.down_proj.grad - ref_down.grad[local]).abs().max().item(),  # type: ignore[operator]
    }
    try:
        ExpertGroup(None, 3, 0, EXPERTS)
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    lamina.shutdown()
    return {"errors": errors, "issued": issued, "refused": refused}


@pytest.mark.parametrize("counts", [(10, 7, 12, 9), (10, 7, 12, 0)], ids=["even", "a rank idle"])
def test_dropless_dispatch_equals_the_whole_layer_in_one_process(counts: tuple[int, ...]) -> None:
    results = run_ranks(_job, 4, args=(counts,), timeout=120)
    for rank, got in enumerate(results):
        for what, error in got["errors"].items():
            assert error < 1e-5, (rank, what, error)
        assert got["issued"] == [
            ("moe.3.counts", "all_to_all", False),
            ("moe.3.tokens", "all_to_all", False),
            ("moe.3.results", "all_to_all", False),
            ("moe.3.results_grad", "all_to_all", True),
            ("moe.3.tokens_grad", "all_to_all", True),
        ], got["issued"]
    refused = results[0]["refused"]
    assert "\n" not in refused
    assert "8 experts do not split over ep=3 ranks; choose an ep degree that divides 8" in refused
