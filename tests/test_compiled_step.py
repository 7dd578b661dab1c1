"""``lamina.compile_step``: the whole DP step (forward, loss, backward, the plan's
all-reduces, the optimizer's update) as one captured graph per rank, against lamina's
eager step on 2 gloo ranks from rank-seeded weights; and its declared fallbacks.

The graphs are compiled with ``aot_eager`` (torch.compile's capture and AOT autograd,
without Inductor's C++ code generation, which costs 15-70 s a model here): what is
tested is the capture, the collectives in it and the update; the benchmark compiles
with Inductor.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lamina
from lamina.errors import ConfigError
from lamina.testing import run_ranks

pytestmark = [pytest.mark.portable, pytest.mark.multiprocess]

STEPS = 5
TOLERANCE = 1e-6


class _Net(nn.Module):
    def __init__(self, branchy: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)
        self.branchy = branchy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.inp(x)))
        if self.branchy and bool(h.sum() > 0):  # data-dependent Python branch
            h = h * 2
        return self.out(h)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _against_eager(optimizer_name: str, branchy: bool) -> dict[str, Any]:
    runtime = lamina.init()
    torch.manual_seed(runtime.rank)  # rank-seeded: only the broadcasts make them equal
    initial = _Net(branchy)
    eager = lamina.distribute(copy.deepcopy(initial), "dp", bucket_cap_mb=0.002)
    compiled = lamina.distribute(copy.deepcopy(initial), "dp", bucket_cap_mb=0.002)
    opt_eager = _optimizer(optimizer_name, eager)
    opt_compiled = _optimizer(optimizer_name, compiled)
    schedule = torch.optim.lr_scheduler.StepLR(opt_compiled, step_size=2, gamma=0.5)
    schedule_eager = torch.optim.lr_scheduler.StepLR(opt_eager, step_size=2, gamma=0.5)
    step = lamina.compile_step(compiled, opt_compiled, F.mse_loss, backend="aot_eager")
    worst_loss = worst_param = 0.0
    for k in range(STEPS):
        generator = torch.Generator().manual_seed(100 * k + runtime.rank)
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        loss = step(x, y)
        opt_eager.zero_grad(set_to_none=True)
        reference = F.mse_loss(eager(x), y)
        reference.backward()
        opt_eager.step()
        schedule.step()
        schedule_eager.step()
        worst_loss = max(worst_loss, abs(float(loss) - float(reference)))
        worst_param = max(
            worst_param,
            max(
                (a - b).abs().max().item()
                for a, b in zip(compiled.parameters(), eager.parameters(), strict=True)
            ),
        )
    plan = compiled.execution_plan
    assert plan is not None
    return {
        "loss": worst_loss,
        "param": worst_param,
        "mode": next(n.detail.mode for n in plan.nodes if n.id == "forward"),
        "summary": compiled.step_summary(),
        "state_keys": sorted(next(iter(opt_compiled.state.values())).keys()),
        "eager_state_keys": sorted(next(iter(opt_eager.state.values())).keys()),
        "buckets": len([n for n in plan.collectives() if n.id.startswith("bucket")]),
        "issued": dict(compiled.run_log.last.issued) if compiled.run_log.last else {},
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_compiled_step_equals_the_eager_step(optimizer: str) -> None:
    for result in run_ranks(_against_eager, 2, args=(optimizer, False), timeout=280):
        assert result["mode"] == "compiled_step:aot_eager", result
        assert result["loss"] <= TOLERANCE and result["param"] <= TOLERANCE, result
        assert result["state_keys"] == result["eager_state_keys"]  # torch's own state
        assert result["buckets"] > 1  # several of the plan's all-reduces in the graph
        assert result["issued"] == {f"bucket{i}.all_reduce": 1 for i in range(result["buckets"])}


def _one_graph() -> dict[str, Any]:
    """The graphs torch.compile captures for the step, read by a backend that records them
    (and runs them as captured)."""
    runtime = lamina.init()
    torch.manual_seed(runtime.rank)
    model = lamina.distribute(_Net(), "dp", bucket_cap_mb=0.002)
    graphs: list[Any] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    step = lamina.compile_step(model, _optimizer("sgd", model), F.mse_loss, backend=recording)
    for k in range(3):
        generator = torch.Generator().manual_seed(k + runtime.rank)
        step(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator))
    plan = model.execution_plan
    reduces = [
        n.args[0].meta["example_value"].numel()
        for n in graphs[0].graph.nodes
        if n.op == "call_function" and "all_reduce" in str(n.target)
    ]
    planned = [n.collective.numel for n in plan.collectives() if n.id.startswith("bucket")]
    return {"graphs": len(graphs), "reduces": reduces, "planned": planned}


@pytest.mark.timeout(300)
def test_one_graph_holds_the_plans_all_reduces_in_order_and_size() -> None:
    for result in run_ranks(_one_graph, 2, timeout=280):
        assert result["graphs"] == 1, result  # captured once, replayed twice
        assert result["reduces"] == result["planned"] and len(result["planned"]) > 1, result


def _shapes() -> dict[str, Any]:
    """Batches of 8, 4, 6, then 8 rows, compiled for at most 2 shapes, against eager."""
    runtime = lamina.init()
    torch.manual_seed(runtime.rank)
    initial = _Net()
    eager = lamina.distribute(copy.deepcopy(initial), "dp")
    compiled = lamina.distribute(copy.deepcopy(initial), "dp")
    opt_eager, opt_compiled = _optimizer("adamw", eager), _optimizer("adamw", compiled)
    step = lamina.compile_step(compiled, opt_compiled, F.mse_loss, backend="aot_eager")
    summaries, worst = [], 0.0
    for k, rows in enumerate((8, 4, 6, 8)):
        generator = torch.Generator().manual_seed(100 * k + runtime.rank)
        x, y = torch.randn(rows, 16, generator=generator), torch.randn(rows, 4, generator=generator)
        step(x, y)
        opt_eager.zero_grad(set_to_none=True)
        F.mse_loss(eager(x), y).backward()
        opt_eager.step()
        summaries.append(compiled.step_summary())
        worst = max(
            worst,
            max(
                (a - b).abs().max().item()
                for a, b in zip(compiled.parameters(), eager.parameters(), strict=True)
            ),
        )
    return {"summaries": summaries, "param": worst, "recompiles": compiled.run_log.recompiles}


@pytest.mark.timeout(300)
def test_a_new_shape_recompiles_once_counted_and_past_the_bound_runs_eagerly() -> None:
    for result in run_ranks(_shapes, 2, timeout=280):
        first, second, third, fourth = result["summaries"]
        assert "recompiled" not in first and "run fallbacks" not in first, result
        assert "recompiled x1 (1 in the run)" in second, result
        assert "max_shapes=2" in third and "[6, 16]" in third, result  # eager, with why
        assert "recompiled" not in fourth and "run fallbacks" not in fourth, result
        assert result["recompiles"] == 1 and result["param"] <= TOLERANCE, result


@pytest.mark.timeout(300)
def test_a_step_that_cannot_be_captured_runs_eagerly_with_the_reason() -> None:
    for result in run_ranks(_against_eager, 2, args=("sgd", True), timeout=280):
        assert result["loss"] <= TOLERANCE and result["param"] <= TOLERANCE, result
        assert "fallback" in result["summary"] and "eager" in result["summary"], result


def test_compile_step_takes_a_dp_model() -> None:
    lamina.init()
    model = lamina.distribute(_Net(), "zero3", min_unit_numel=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="compile_step takes a model distributed with 'dp'"):
        lamina.compile_step(model, opt, F.mse_loss)
    dp = lamina.distribute(_Net(), "dp")
    with pytest.raises(ConfigError, match="max_shapes=0; pass how many input shapes"):
        lamina.compile_step(dp, torch.optim.SGD(dp.parameters(), lr=0.1), F.mse_loss, max_shapes=0)


def test_an_optimizer_whose_update_is_not_traced_is_a_plan_fallback_with_the_reason() -> None:
    lamina.init()
    torch.manual_seed(0)
    model = lamina.distribute(_Net(), "dp")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    step = lamina.compile_step(model, optimizer, F.mse_loss, backend="aot_eager")
    before = [p.detach().clone() for p in model.parameters()]
    step(torch.randn(4, 16), torch.randn(4, 4))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    taken = [f for f in model.execution_plan.fallbacks if f.taken and f.node == "forward"]
    assert [f.reason for f in taken] == ["the optimizer: Adagrad is not one of SGD, Adam, AdamW"], (
        model.execution_plan.fallbacks
    )
    assert "compiled_step:aot_eager -> eager" in model.step_summary()
