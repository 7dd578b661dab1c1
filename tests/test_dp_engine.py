"""The DP engine against torch DDP on real ranks, and its planning and controls."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.errors import ConfigError
from lamina.testing import run_ranks
from models_for_tests import batch, build, loss_of

STEPS = 5


def _compare_with_ddp(name: str) -> dict[str, object]:
    runtime = lamina.init()
    reference = build(name)
    ours = lamina.distribute(
        copy.deepcopy(reference), "dp", bucket_cap_mb=0.004, first_bucket_mb=0.001
    )
    ddp = DDP(reference, find_unused_parameters=(name == "unused"))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch(name, step, runtime.rank)
        for model, opt in ((ours, opt_ours), (ddp, opt_ddp)):
            loss_of(name, model(x), y).backward()
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
    gathered = [torch.zeros(1) for _ in range(runtime.world_size)]
    first = next(ours.module.parameters()).detach().flatten()[:1].clone()
    dist.all_gather(gathered, first)
    assert ours.plan is not None and ours.graph is not None
    return {
        "diff": diff,
        "buffer_diff": max(buffers, default=0.0),
        "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
        "buckets": len(ours.plan.buckets),
        "excluded": ours.plan.excluded,
        "launched_in_backward": ours.reducer.stats.launched_in_backward,  # type: ignore[union-attr]
        "method": ours.graph.method,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["mlp", "gpt", "tied", "unused", "batchnorm"])
def test_dp_matches_ddp_after_five_steps(name: str) -> None:
    results = run_ranks(_compare_with_ddp, 2, args=(name,), timeout=200)
    for result in results:
        assert result["diff"] <= 1e-6, result
        assert result["buffer_diff"] <= 1e-6, result
        assert result["ranks_agree"], result
        assert result["buckets"] >= 2, result  # small caps: several buckets overlap backward
        assert result["launched_in_backward"] >= 1, result
    if name == "unused":
        assert results[0]["excluded"] == ("never.weight", "never.bias")


def _accumulation_equals_large_batch() -> float:
    runtime = lamina.init()
    micro = lamina.distribute(build("mlp"), "dp", bucket_cap_mb=0.004, first_bucket_mb=0.001)
    large = lamina.distribute(build("mlp"), "dp")
    parts = [batch("mlp", k, runtime.rank, size=4) for k in range(4)]
    for k, (x, y) in enumerate(parts):
        loss = loss_of("mlp", micro(x), y) / 4
        if k < 3:
            with micro.no_sync():  # type: ignore[operator]
                loss.backward()
        else:
            loss.backward()
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    loss_of("mlp", large(x), y).backward()
    return max(
        (a.grad - b.grad).abs().max().item()  # type: ignore[operator]
        for a, b in zip(micro.parameters(), large.parameters(), strict=True)
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_gradient_accumulation_over_four_micro_steps_equals_one_large_batch() -> None:
    for diff in run_ranks(_accumulation_equals_large_batch, 2, timeout=150):
        assert diff <= 1e-6


def _kwargs_eval_and_no_grad() -> bool:
    lamina.init()

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


@pytest.mark.multiprocess
def test_kwargs_eval_and_no_grad_forwards_work() -> None:
    assert run_ranks(_kwargs_eval_and_no_grad, 2, timeout=120) == [True, True]


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
    with pytest.raises(ConfigError, match="unknown strategy 'ddp'; choose one of dp, zero3"):
        lamina.distribute(build("mlp"), "ddp")
