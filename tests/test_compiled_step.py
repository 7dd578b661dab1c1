"""``lamina.compile_step``: the whole step (forward, loss, backward, the plan's
collectives, the optimizer's update) as one captured graph per rank, for ``dp``,
``zero3`` and ``hsdp``, against lamina's eager step from rank-seeded weights: on 2 gloo
ranks, and on 4 of a declared 2-host x 2-rank topology (where the plans choose the
hierarchical algorithm); the GPT example with dropout and a Hugging Face Llama; the
pre-flight comparison of the captured graphs; and the declared fallbacks.

The graphs are compiled with ``aot_eager`` (torch.compile's capture and AOT autograd,
without Inductor's C++ code generation, which costs 15-70 s a model here): what is
tested is the capture, the collectives in it and the update; the benchmark compiles
with Inductor.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lamina
from lamina.errors import ConfigError, VerificationError
from lamina.strategies.compiled.graph_collectives import mismatch
from lamina.testing import run_ranks
from models_for_tests import (
    GPT,
    GPTConfig,
    WithUnused,
    batch,
    build,
    full_params,
    tiny_llama,
)
from topologies_for_tests import two_hosts_of_two

pytestmark = [pytest.mark.portable, pytest.mark.multiprocess]

STEPS = 5
TOLERANCE = 1e-6
#: A total norm every step's gradients exceed: the clipping really scales them.
CLIP = 0.05


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


def _optimizer(name: str, model: nn.Module, adamw_lr: float = 1e-2) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=adamw_lr)


#: AdamW's learning rate where four ranks sum (see tests/test_hsdp.py): AdamW turns the
#: fp32 rounding of a near-zero gradient into steps of up to ``lr``, and the graph's
#: update rounds as AOT autograd's decomposition of torch's ops does.
ADAMW_LR = 1e-3


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
        "graphs": len(step.checked.graphs),
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
        assert result["graphs"] == 1, result  # the LR schedule changes no graph


def _one_graph() -> dict[str, Any]:
    """The graphs torch.compile captures for the step, read by a backend that records them
    (and runs them as captured); the check of the graph's collectives against the plan's
    calls, as captured and with the first or the last one left out."""
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
    calls, found = step.checked.planned(), step.checked.graphs[0]
    return {
        "graphs": len(graphs),
        "reduces": reduces,
        "planned": planned,
        "as_captured": mismatch(calls, found),
        "first_missing": mismatch(calls, found[1:]),
        "last_missing": mismatch(calls, found[:-1]),
    }


@pytest.mark.timeout(300)
def test_one_graph_holds_the_plans_all_reduces_in_order_and_size() -> None:
    for result in run_ranks(_one_graph, 2, timeout=280):
        assert result["graphs"] == 1, result  # captured once, replayed twice
        assert result["reduces"] == result["planned"] and len(result["planned"]) > 1, result
        # the check of the graph against the plan: the graph's collectives less one differ
        first, second = result["planned"][:2]
        assert first != second, result  # the first bucket's call is named, not counted
        assert result["first_missing"] == (
            f"collective 0 of the captured graph is all_reduce of {second} elements, "
            f"the plan's node bucket0.all_reduce issues all_reduce of {first}"
        ), result
        count = len(result["planned"])
        assert result["last_missing"] == (
            f"the captured graph issues {count - 1} collectives, the plan {count}"
        ), result
        assert result["as_captured"] == "", result


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


def test_compile_step_takes_a_distributed_model_and_valid_options() -> None:
    lamina.init()
    plain = _Net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="compile_step takes a model distributed with 'dp'"):
        lamina.compile_step(plain, opt, F.mse_loss)
    dp = lamina.distribute(_Net(), "dp")
    with pytest.raises(ConfigError, match="on_graph_break='never'; pass 'eager'"):
        lamina.compile_step(dp, opt, F.mse_loss, on_graph_break="never")
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


# -- zero3, hsdp and dp on a declared 2 x 2 topology ----------------------------------------
def _strategy_against_eager(
    strategy: str,
    optimizer_name: str,
    initial: nn.Module,
    data: Any,
    loss_fn: Any,
    max_norm: float | None = None,
) -> dict[str, Any]:
    """5 steps of ``strategy``'s compiled step against its eager step, from ``initial``
    (rank-seeded), both drawing dropout from the same seed each step (with ``max_norm``,
    both clipping: the eager step with ``model.clip_grad_norm_``). The loss is compared
    relative to its size (above 1): the graph's optimizer arithmetic is torch's, but AOT
    autograd decomposes some of its ops, so the parameters differ by fp32 rounding."""
    options: dict[str, Any] = {"bucket_cap_mb": 0.002} if strategy == "dp" else {}
    if strategy != "dp":
        options["min_unit_numel"] = 0
    eager = lamina.distribute(copy.deepcopy(initial), strategy, **options)
    compiled = lamina.distribute(copy.deepcopy(initial), strategy, **options)
    opt_eager = _optimizer(optimizer_name, eager, ADAMW_LR)
    opt_compiled = _optimizer(optimizer_name, compiled, ADAMW_LR)
    step = lamina.compile_step(
        compiled, opt_compiled, loss_fn, backend="aot_eager", max_norm=max_norm
    )
    worst_loss = worst_norm = 0.0
    norms = []
    for k in range(STEPS):
        x, y = data(k)
        torch.manual_seed(1000 + k)  # the same dropout masks, if the graph draws as eager
        loss = step(x, y)
        torch.manual_seed(1000 + k)
        opt_eager.zero_grad(set_to_none=True)
        reference = loss_fn(eager(x), y)
        reference.backward()
        if max_norm is not None:
            norm = float(eager.clip_grad_norm_(max_norm))
            assert step.last_grad_norm is not None
            norms.append(norm)
            worst_norm = max(worst_norm, abs(float(step.last_grad_norm) - norm) / norm)
        opt_eager.step()
        expected = float(reference.detach())
        worst_loss = max(worst_loss, abs(float(loss) - expected) / max(1.0, abs(expected)))
    ours, theirs = full_params(compiled), full_params(eager)
    plan = compiled.execution_plan
    return {
        "loss": worst_loss,
        "param": max((ours[n] - theirs[n]).abs().max().item() for n in ours),
        "graphs": [[c.line() for c in graph] for graph in step.checked.graphs],
        "modes": sorted({n.detail.mode for n in plan.nodes if hasattr(n.detail, "mode")}),
        "algorithms": sorted({n.algorithm.name for n in plan.collectives() if n.algorithm}),
        "summary": compiled.step_summary(),
        "eager_reason": step.eager_reason,
        "norms": norms,
        "norm": worst_norm,
    }


def _on_two_hosts() -> dict[str, Any]:
    runtime = lamina.init(mesh="topology")
    initial = build("mlp", seed=runtime.rank)  # four blocks: four units

    def data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch("mlp", k, runtime.rank)

    # one optimizer each (both are compiled against eager on 2 ranks above): every
    # strategy x optimizer pair here cost 190 s of the test command's two cores
    # hsdp clips at a norm every step exceeds: the norm over the shard group, whose
    # replicas hold the same shards
    runs = [("zero3", "sgd", None), ("hsdp", "adamw", CLIP), ("dp", "adamw", None)]
    return {
        f"{s}/{o}": _strategy_against_eager(s, o, initial, data, F.mse_loss, clip)
        for s, o, clip in runs
    }


@pytest.fixture(scope="module")
def topology_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("compiled") / "two_hosts_of_two.json"
    path.write_text(json.dumps(two_hosts_of_two()))
    return str(path)


@pytest.mark.timeout(400)
def test_zero3_hsdp_and_dp_compiled_steps_equal_eager_on_two_hosts_of_two(
    topology_file: str,
) -> None:
    results = run_ranks(_on_two_hosts, 4, env={"LAMINA_TOPOLOGY": topology_file}, timeout=380)
    for rank, by_run in enumerate(results):
        for run, result in by_run.items():
            assert result["eager_reason"] == "" and result["modes"] == ["compiled_step:aot_eager"]
            assert result["loss"] <= TOLERANCE and result["param"] <= TOLERANCE, (rank, run, result)
            assert len(result["graphs"]) == 1, (run, result)  # captured once, replayed
            # the same collectives, in the same order, on every rank (the pre-flight check)
            assert result["graphs"] == results[0][run]["graphs"], (rank, run)
    zero3, hsdp, dp = (results[0][k] for k in ("zero3/sgd", "hsdp/adamw", "dp/adamw"))
    assert zero3["algorithms"] == ["hierarchical"], zero3  # kept in the graph: two phases
    assert any("over 2 ranks" in line for line in zero3["graphs"][0]), zero3
    assert "gather again for backward -> kept gathered from its forward" in zero3["summary"]
    assert any("all_reduce" in line for line in hsdp["graphs"][0]), hsdp  # across replicas
    assert min(hsdp["norms"]) > CLIP and hsdp["norm"] <= TOLERANCE, hsdp  # clipped alike
    assert "all_reduce 1 x float32 over 2 ranks" in hsdp["graphs"][0], hsdp  # the norm
    assert "hierarchical" in dp["algorithms"], dp


# -- the GPT example with dropout, and a Hugging Face Llama ---------------------------------
def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _language_models() -> dict[str, Any]:
    runtime = lamina.init()
    torch.manual_seed(runtime.rank)
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, dropout=0.2))
    llama = tiny_llama(runtime.rank, num_hidden_layers=1)  # one layer: its ops, half the trace

    def data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch("gpt", k, runtime.rank)

    return {
        "gpt/zero3": _strategy_against_eager("zero3", "sgd", gpt, data, _lm_loss),
        "llama/dp": _strategy_against_eager("dp", "adamw", llama, data, _lm_loss),
    }


@pytest.mark.timeout(400)
def test_the_gpt_with_dropout_and_a_hugging_face_llama_compile_to_the_eager_step() -> None:
    for result in run_ranks(_language_models, 2, timeout=380):
        for run, outcome in result.items():
            assert outcome["eager_reason"] == "", (run, outcome)
            assert outcome["loss"] <= TOLERANCE and outcome["param"] <= TOLERANCE, (run, outcome)


# -- graph breaks, named; the pre-flight check of the captured graphs -----------------------
class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if os.environ.get("RANK", "0") == os.environ.get("BREAK_ON_RANK", "0"):
            torch._dynamo.graph_break()  # a rank that cannot capture its step
        return h


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(self.first(x))
        return out


def test_a_graph_break_is_an_error_naming_the_module_and_the_operation() -> None:
    lamina.init()
    model = lamina.distribute(_Outer(), "dp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = lamina.compile_step(
        model, optimizer, F.mse_loss, backend="aot_eager", on_graph_break="error"
    )
    with pytest.raises(ConfigError) as caught:
        step(torch.randn(4, 16), torch.randn(4, 16))
    message = str(caught.value)
    assert "graph break in module 'inner' (_Inner.forward" in message, message
    assert "torch._dynamo.graph_break()" in message and "on_graph_break='eager'" in message


def _one_rank_breaks() -> str:
    runtime = lamina.init()
    model = lamina.distribute(_Outer(), "dp")
    step = lamina.compile_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, backend="aot_eager"
    )
    try:
        step(torch.randn(4, 16), torch.randn(4, 16))
    except VerificationError as exc:
        return str(exc)
    return f"rank {runtime.rank} ran"


@pytest.mark.timeout(200)
def test_a_rank_whose_capture_stops_is_named_by_the_preflight_check() -> None:
    messages = run_ranks(_one_rank_breaks, 2, env={"BREAK_ON_RANK": "1"}, timeout=180)
    for message in messages:
        assert "differ from rank 0 in compiled_graph" in message, messages
        assert "no graph: the capture stopped" in message, messages


def test_a_zero3_parameter_no_forward_reaches_is_a_plan_fallback() -> None:
    lamina.init()
    torch.manual_seed(0)
    model = lamina.distribute(WithUnused(), "zero3", min_unit_numel=0)
    step = lamina.compile_step(
        model, torch.optim.AdamW(model.parameters(), lr=0.1), F.mse_loss, backend="aot_eager"
    )
    for _ in range(2):
        step(torch.randn(4, 16), torch.randn(4, 16))
    taken = [f for f in model.execution_plan.fallbacks if f.taken and f.alternative == "eager"]
    assert len(taken) == 1 and "2 parameter(s) no rank's forward reached" in taken[0].reason
    assert "never.weight" in taken[0].reason


def test_device_graphs_say_why_a_step_launches_kernel_by_kernel() -> None:
    runtime = lamina.init()
    from lamina.strategies.compiled.device_graph import DeviceGraphs

    cpu = DeviceGraphs(runtime.handle, True, "inductor")
    assert cpu.reason == runtime.handle.graph_capture_reason() and "cpu" in cpu.reason
    assert cpu.device is None  # the step's small tensors stay where they are
    assert DeviceGraphs(runtime.handle, False, "inductor").reason == "device_graphs=False"
    assert DeviceGraphs(None, True, "inductor").reason == "no lamina runtime: the device is unknown"
    model = lamina.distribute(_Net(), "dp")
    step = lamina.compile_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, backend="aot_eager"
    )
    step(torch.randn(4, 16), torch.randn(4, 4))
    meta = dict(model.execution_plan.meta)
    assert meta["device_graphs"] == f"no: {runtime.handle.graph_capture_reason()}"


def test_more_compiled_steps_than_torch_compiles_per_function_each_keep_their_graph() -> None:
    """torch.compile caches graphs per code object, 8 by default: each step has its own."""
    lamina.init()
    steps = []
    for _ in range(10):
        model = lamina.distribute(_Net(), "dp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps.append(lamina.compile_step(model, opt, F.mse_loss, backend="aot_eager"))
    for _ in range(2):
        for step in steps:
            step(torch.randn(4, 16), torch.randn(4, 4))
    assert all(s.eager_reason == "" and len(s.checked.graphs) == 1 for s in steps), [
        s.eager_reason for s in steps
    ]


def test_a_zero3_unit_with_a_frozen_parameter_compiles_to_the_eager_step() -> None:
    lamina.init()
    initial = build("mlp", seed=0)
    initial.layers[1].weight.requires_grad_(False)  # type: ignore[index]
    models = [lamina.distribute(copy.deepcopy(initial), "zero3", min_unit_numel=0) for _ in "ab"]
    eager, compiled = models
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    step = lamina.compile_step(compiled, opts[1], F.mse_loss, backend="aot_eager")
    for k in range(3):
        x, y = batch("mlp", k, 0)
        step(x, y)
        opts[0].zero_grad(set_to_none=True)
        F.mse_loss(eager(x), y).backward()
        opts[0].step()
    assert step.eager_reason == "" and len(step.checked.graphs) == 1
    ours, theirs = full_params(compiled), full_params(eager)
    assert max((ours[n] - theirs[n]).abs().max().item() for n in ours) <= TOLERANCE
    assert torch.equal(ours["layers.1.weight"], initial.layers[1].weight)  # type: ignore[index]


class _Blocks(nn.Module):
    """Three blocks, the middle one breaking the capture."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), _Inner(), nn.Linear(16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_zero3_step_that_cannot_be_captured_gathers_again_as_its_plan_says() -> None:
    lamina.init()
    torch.manual_seed(0)
    model = lamina.distribute(_Blocks(), "zero3", min_unit_numel=0)
    step = lamina.compile_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, backend="aot_eager"
    )
    for _ in range(3):  # eager, then the capture stops at the graph break: eager again
        step(torch.randn(4, 16), torch.randn(4, 16))
    summary = model.step_summary()
    reason = step.eager_reason
    assert "graph break in module 'blocks.1' (_Inner.forward" in reason, reason
    assert "run fallbacks" in summary and "kept gathered" not in summary, summary
    kept = [f for f in model.execution_plan.fallbacks if f.alternative.startswith("kept")]
    assert kept and not any(f.taken for f in kept)


def _clipped_against_eager(strategy: str, optimizer_name: str) -> dict[str, Any]:
    """5 steps of ``strategy``'s compiled step clipping at :data:`CLIP` against its eager
    step clipping with ``model.clip_grad_norm_`` (rank-seeded weights and batches)."""
    runtime = lamina.init()
    torch.manual_seed(runtime.rank)
    initial = _Net()
    options: dict[str, Any] = {"bucket_cap_mb": 0.002} if strategy == "dp" else {}
    eager = lamina.distribute(copy.deepcopy(initial), strategy, **options)
    compiled = lamina.distribute(copy.deepcopy(initial), strategy, **options)
    opt_eager = _optimizer(optimizer_name, eager, ADAMW_LR)
    opt_compiled = _optimizer(optimizer_name, compiled, ADAMW_LR)
    step = lamina.compile_step(
        compiled, opt_compiled, F.mse_loss, backend="aot_eager", max_norm=CLIP
    )
    worst_loss = worst_norm = 0.0
    norms = []
    for k in range(STEPS):
        generator = torch.Generator().manual_seed(100 * k + runtime.rank)
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        loss = step(x, y)
        opt_eager.zero_grad(set_to_none=True)
        reference = F.mse_loss(eager(x), y)
        reference.backward()
        norm = eager.clip_grad_norm_(CLIP)
        opt_eager.step()
        assert step.last_grad_norm is not None
        norms.append(float(norm))
        worst_loss = max(worst_loss, abs(float(loss) - float(reference)))
        worst_norm = max(worst_norm, abs(float(step.last_grad_norm) - float(norm)) / float(norm))
    ours, theirs = full_params(compiled), full_params(eager)
    plan = compiled.execution_plan
    assert plan is not None
    return {
        "loss": worst_loss,
        "norm": worst_norm,
        "norms": norms,
        "param": max((ours[n] - theirs[n]).abs().max().item() for n in ours),
        "modes": sorted({n.detail.mode for n in plan.nodes if hasattr(n.detail, "mode")}),
        "eager_reason": step.eager_reason,
        "norm_node": dict(compiled.run_log.last.issued).get("grad_norm.all_reduce", 0)
        if compiled.run_log.last
        else 0,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "optimizer"), [("dp", "sgd"), ("zero3", "adamw")])
def test_clipping_in_the_compiled_step_equals_the_eager_step_clipping(
    strategy: str, optimizer: str
) -> None:
    for result in run_ranks(_clipped_against_eager, 2, args=(strategy, optimizer), timeout=280):
        assert min(result["norms"]) > CLIP, result  # every step clipped
        assert result["loss"] <= TOLERANCE and result["param"] <= TOLERANCE, result
        assert result["norm"] <= TOLERANCE, result
        assert result["modes"] == ["compiled_step:aot_eager"], result  # in the graph
        assert result["eager_reason"] == "", result
        if strategy == "zero3":  # each rank's part of the norm summed over the shards
            assert result["norm_node"] == 1, result


def test_compile_step_refuses_a_max_norm_that_is_not_a_positive_number() -> None:
    lamina.init()
    model = lamina.distribute(_Net(), "dp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0, -1.0, "1.0"):
        with pytest.raises(ConfigError) as error:
            lamina.compile_step(model, opt, F.mse_loss, max_norm=bad)  # type: ignore[arg-type]
        assert "\n" not in str(error.value)
        assert str(error.value).startswith(f"compile_step: max_norm={bad!r}; pass the total")
