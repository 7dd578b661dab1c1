"""The DP engine against torch DDP on real ranks, and its planning and controls.

Every rank builds its model from its own seed, so the ranks start apart and only the
wrap-time broadcast of rank 0's state (lamina's and DDP's own) makes them agree; the
gradients are compared with DDP's after every backward, before the optimizer step, so
a wrongly scaled average fails even where AdamW's update would hide it. Spawning ranks
is the slow part: one module-scoped job runs every 2-rank configuration, and the tests,
one per behaviour, assert on their part of its results.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.errors import ConfigError
from lamina.testing import run_ranks
from models_for_tests import MLP, batch, build, differs_from_rank0, grad_diff, loss_of

pytestmark = [pytest.mark.portable, pytest.mark.cross_release]

STEPS = 5
NAMES = ("mlp", "gpt", "tied", "unused", "batchnorm")
#: Small bucket caps: the models' gradients land in several buckets.
SMALL_BUCKETS: dict[str, Any] = {"bucket_cap_mb": 0.004, "first_bucket_mb": 0.001}
#: fp32 results that differ only in the order of rounding: lamina and DDP both average two
#: ranks' shares (one addition each); 1e-6 relative is a few ulps of float32 (2**-23 ~ 1.2e-7)
#: compounded over 5 steps, and orders of magnitude below any wrong scale (>= 0.5).
TOLERANCE = 1e-6


def _compare_with_ddp(name: str, rank: int, world: int) -> dict[str, object]:
    initial = build(name, seed=rank)  # ranks start apart: only the broadcasts align them
    ours = lamina.distribute(copy.deepcopy(initial), "dp", **SMALL_BUCKETS)
    ddp = DDP(copy.deepcopy(initial), find_unused_parameters=(name == "unused"))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    grad_diffs = []
    for step in range(STEPS):
        x, y = batch(name, step, rank)
        for model in (ours, ddp):
            loss_of(name, model(x), y).backward()
        grad_diffs.append(grad_diff(ours.module.parameters(), ddp.module.parameters()))
        for opt in (opt_ours, opt_ddp):
            opt.step()
            opt.zero_grad(set_to_none=True)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(ours.module.parameters(), ddp.module.parameters(), strict=True)
    )
    buffers = [
        (a - b).abs().max().item()
        for a, b in zip(ours.module.buffers(), ddp.module.buffers(), strict=True)
        if a.is_floating_point()
    ]
    gathered = [torch.zeros(1) for _ in range(world)]
    first = next(ours.module.parameters()).detach().flatten()[:1].clone()
    dist.all_gather(gathered, first)
    assert ours.plan is not None and ours.graph is not None
    return {
        "started_apart": differs_from_rank0(name, initial),
        "grad_diffs": grad_diffs,
        "diff": diff,
        "buffer_diff": max(buffers, default=0.0),
        "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
        "buckets": len(ours.plan.buckets),
        "excluded": ours.plan.excluded,
        "launched_in_backward": ours.reducer.stats.launched_in_backward,  # type: ignore[union-attr]
        "method": ours.graph.method,
    }


class LateBranch(MLP):
    """The tests' small MLP with a layer the forward uses only once ``use_late`` is set:
    captured without it, the layer is excluded from the buckets as unused."""

    def __init__(self) -> None:
        super().__init__(width=16, depth=3)
        self.late = torch.nn.Linear(16, 16)
        self.use_late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_late:
            x = x + self.late(x)
        return super().forward(x)


def _late_parameters_like_ddp(rank: int, used_on: tuple[int, ...] = (0, 1)) -> dict[str, object]:
    """Parameters excluded while planning that get gradients later (on the ranks in
    ``used_on``) are still averaged."""
    torch.manual_seed(rank)
    initial = LateBranch()
    example = batch("unused", 0, rank)[0]
    ours = lamina.distribute(copy.deepcopy(initial), "dp", example_inputs=(example,))
    ours.module.use_late = rank in used_on  # type: ignore[union-attr]
    initial.use_late = rank in used_on
    ddp = DDP(copy.deepcopy(initial), find_unused_parameters=used_on != (0, 1))
    grad_diffs = []
    for step in range(3):
        x, y = batch("unused", step, rank)
        for model in (ours, ddp):
            loss_of("unused", model(x), y).backward()
        grad_diffs.append(grad_diff(ours.module.parameters(), ddp.module.parameters()))
        for model in (ours, ddp):
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad  # type: ignore[operator]
                    p.grad = None
    assert ours.plan is not None and ours.reducer is not None
    return {
        "excluded": ours.plan.excluded,
        "stray_params": ours.reducer.stats.stray_params,
        "grad_diffs": grad_diffs,
    }


def _accumulation(rank: int, world: int) -> dict[str, object]:
    """Four micro-batches, three under ``no_sync()``: lamina against DDP + ``no_sync()``
    (after every micro-step), a one-large-batch lamina run, and one process computing the
    gradient of the whole global batch from rank 0's weights."""
    initial = build("mlp", seed=rank)
    micro = lamina.distribute(copy.deepcopy(initial), "dp", **SMALL_BUCKETS)
    large = lamina.distribute(copy.deepcopy(initial), "dp")
    ddp = DDP(copy.deepcopy(initial))
    parts = [batch("mlp", k, rank, size=4) for k in range(4)]
    micro_diffs = []
    for k, (x, y) in enumerate(parts):
        last = k == len(parts) - 1
        loss = loss_of("mlp", micro(x), y) / 4  # the first forward plans: no_sync after it
        if last:
            loss.backward()
            loss_of("mlp", ddp(x), y).div(4).backward()
        else:
            with micro.no_sync():  # type: ignore[operator]
                loss.backward()
            with ddp.no_sync():  # DDP's no_sync must cover the forward too
                loss_of("mlp", ddp(x), y).div(4).backward()
        # under no_sync both hold this rank's local sum; after the last, the global mean
        micro_diffs.append(grad_diff(micro.parameters(), ddp.parameters()))
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    loss_of("mlp", large(x), y).backward()
    # the whole global batch (every rank's micro-batches) in one process, rank 0's weights
    single = build("mlp", seed=0)
    everything = [batch("mlp", k, r, size=4) for r in range(world) for k in range(4)]
    xs = torch.cat([p[0] for p in everything])
    ys = torch.cat([p[1] for p in everything])
    loss_of("mlp", single(xs), ys).backward()
    return {
        "micro_vs_ddp": micro_diffs,
        "micro_vs_large": grad_diff(micro.parameters(), large.parameters()),
        "micro_vs_single_process": grad_diff(micro.parameters(), single.parameters()),
    }


def _kwargs_eval_and_no_grad() -> bool:
    class KwModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
            out: torch.Tensor = self.lin(x) * scale
            return out

    model = lamina.distribute(KwModel(), "dp")
    x = torch.randn(3, 4)
    model(x, scale=2.0).sum().backward()
    model.eval()
    with torch.no_grad():
        model(x, scale=0.5)
    model.train()
    model(x, scale=1.0).sum().backward()
    grad = model.module.lin.weight.grad  # type: ignore[union-attr]
    return grad is not None and bool(torch.isfinite(grad).all())


def _dp_job() -> dict[str, Any]:
    """Every 2-rank DP configuration of this module on this rank."""
    runtime = lamina.init()
    rank, world = runtime.rank, runtime.world_size
    return {
        "ddp": {name: _compare_with_ddp(name, rank, world) for name in NAMES},
        "accumulation": _accumulation(rank, world),
        "late": _late_parameters_like_ddp(rank),
        "late_on_rank_1": _late_parameters_like_ddp(rank, used_on=(1,)),
        "kwargs": _kwargs_eval_and_no_grad(),
    }


@pytest.fixture(scope="module")
def dp_results() -> list[dict[str, Any]]:
    return run_ranks(_dp_job, 2, timeout=200)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", NAMES)
def test_dp_matches_ddp_after_five_steps(name: str, dp_results: list[dict[str, Any]]) -> None:
    results = [r["ddp"][name] for r in dp_results]
    assert results[1]["started_apart"], results[1]  # rank 1 built other weights than rank 0
    for result in results:
        assert max(result["grad_diffs"]) <= TOLERANCE, result  # every step, before the step
        assert result["diff"] <= TOLERANCE, result
        assert result["buffer_diff"] <= TOLERANCE, result
        assert result["ranks_agree"], result
        assert result["buckets"] >= 2, result  # small caps: several buckets overlap backward
        assert result["launched_in_backward"] >= 1, result
    if name == "unused":
        assert results[0]["excluded"] == ("never.weight", "never.bias")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_gradient_accumulation_over_four_micro_steps_equals_one_large_batch(
    dp_results: list[dict[str, Any]],
) -> None:
    for result in (r["accumulation"] for r in dp_results):
        # local sums under no_sync, and the global mean after the synchronizing backward
        assert max(result["micro_vs_ddp"]) <= TOLERANCE, result
        assert result["micro_vs_large"] <= TOLERANCE, result
        # one process over the 32 samples sums in another order than 2 ranks x 4 micro
        # batches of 4: a few float32 ulps, far below a wrong average (>= 0.5)
        assert result["micro_vs_single_process"] <= 1e-5, result


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_parameters_unused_when_planned_but_used_later_are_averaged_like_ddp(
    dp_results: list[dict[str, Any]],
) -> None:
    for result in (r["late"] for r in dp_results):
        assert result["excluded"] == ("late.weight", "late.bias"), result
        assert result["stray_params"] >= 2, result  # the excluded all-reduce ran
        assert max(result["grad_diffs"]) <= TOLERANCE, result


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_parameters_used_on_one_rank_only_are_averaged_like_ddp(
    dp_results: list[dict[str, Any]],
) -> None:
    # rank 0 has no gradient for them, yet issues the same all-reduce (zeros and a flag):
    # a collective on rank 1 only would hang or pair with the wrong one
    for result in (r["late_on_rank_1"] for r in dp_results):
        assert result["excluded"] == ("late.weight", "late.bias"), result
        assert result["stray_params"] >= 2, result
        assert max(result["grad_diffs"]) <= TOLERANCE, result


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_kwargs_eval_and_no_grad_forwards_work(dp_results: list[dict[str, Any]]) -> None:
    assert [r["kwargs"] for r in dp_results] == [True, True]


def test_single_process_plan_from_example_inputs_prints_a_table() -> None:
    lamina.init()
    x, _ = batch("mlp", 0, 0)
    model = lamina.distribute(build("mlp"), "dp", example_inputs=(x,), first_bucket_mb=0.001)
    plan = model.plan  # type: ignore[union-attr]
    assert plan is not None and len(plan.buckets) >= 2
    assert plan.buckets[0].param_names[0] == "layers.3.bias"  # last layer's grads come first
    assert "all_reduce" in plan.table()


def test_unknown_strategy_is_a_clear_error() -> None:
    lamina.init()
    with pytest.raises(ConfigError, match="unknown strategy 'ddp'; choose one of dp, zero3, hsdp"):
        lamina.distribute(build("mlp"), "ddp")
