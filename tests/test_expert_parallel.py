"""Expert parallelism (``"ep"``): MoE experts spread over ranks train as one process.

On 4 gloo ranks, against one process on the same global batch, from the same weights
(rank 0's, broadcast): transformers' Mixtral and Qwen3-MoE built from configs (8
experts, top-2, the router's load-balancing loss in the loss), ``["ep", "zero3"]`` with
ep=2 x dp_shard=2 and ``"ep"`` alone with ep=4, SGD and AdamW, 5 steps: the mean of the
ranks' losses (load-balancing loss included, computed over the global batch) within 1e-6
relative of one process's, every parameter within 1e-5. Every step's run log holds
exactly the plan's ep collectives. Each rank holds ``1 / (ep x dp_shard)`` of the expert
weights and of their optimizer state. A checkpoint saved under ep=4 loads exactly under
ep=2 x dp_shard=2 and in one process. An expert count ep does not divide and a model
without an MoE layer are one line each, before any collective. On 8 ranks,
``["tp", "ep", "zero3"]`` and ``["pp", "ep", "zero3"]`` (the pipeline syncing ep's
gradients once per step) train as one process within the same bounds. ``lamina trace
report`` shows each rank's expert load, every assignment sent once and computed once.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import lamina
from lamina.errors import ConfigError
from lamina.testing import run_ranks
from modern_models import VOCAB, mixtral, qwen3_moe

pytestmark = [pytest.mark.multiprocess]

BATCH, SEQ, STEPS = 2, 16, 5

MODELS = {
    "mixtral": lambda: mixtral(seed=0, experts=8, router_loss=True),
    "qwen3_moe": lambda: qwen3_moe(seed=0, experts=8, router_loss=True),
}
PLAIN_MODELS = {
    "mixtral": lambda: mixtral(seed=0, experts=8),
    "qwen3_moe": lambda: qwen3_moe(seed=0, experts=8),
}


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name (collective under ep and zero3: every rank)."""
    names = {n for n, _ in model.named_parameters()}
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v
        for k, v in model.state_dict().items()
        if k in names
    }


def _local_numel(tensors: list[torch.Tensor]) -> int:
    return sum((t._local_tensor if isinstance(t, DTensor) else t).numel() for t in tensors)


def _next_token(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The causal LM loss a pipeline's last stage computes from the logits."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(strategies: list[str], name: str, optimizer: str) -> dict[str, Any]:
    pipelined = "pp" in strategies
    # a pipeline's loss is the user's loss_fn on the last stage's logits: no router loss
    reference = MODELS[name]() if not pipelined else PLAIN_MODELS[name]()
    ours = copy.deepcopy(reference)
    if dist.get_rank():  # other weights: the setup broadcast makes rank 0's everyone's
        torch.manual_seed(dist.get_rank())
        with torch.no_grad():
            for p in ours.parameters():
                p.normal_()
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, VOCAB, (STEPS * 4, BATCH, SEQ), generator=g)
    extra = {"microbatches": 2} if pipelined else {}
    model = lamina.distribute(ours, strategies, example_inputs=(xs[0],), **extra)
    replica, replicas = model.data_replica
    make = (
        (lambda p: torch.optim.SGD(p, lr=0.1))
        if optimizer == "sgd"
        else (lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-6))
    )
    opt_ref, opt_ours = make(reference.parameters()), make(model.parameters())
    state = model.lamina_ep
    planned = {
        n.id for n in state.execution_plan.nodes if n.kind == "collective" and n.phase != "setup"
    }
    loss_errors, recorded = [], []
    for step in range(STEPS):
        batches = xs[step * replicas : (step + 1) * replicas]
        whole = batches.reshape(-1, SEQ)
        mine = batches[replica]
        if pipelined:
            want = _next_token(reference(input_ids=whole).logits, whole)
            want.backward()
            loss = model.step(mine, mine, _next_token)
        else:
            want = reference(input_ids=whole, labels=whole).loss
            want.backward()
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
        for opt in (opt_ref, opt_ours):
            opt.step()
            opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        loss_errors.append(abs(mean.item() - want.item()) / abs(want.item()))
        last = state.run_log.current  # under a pipeline: counted over the steps so far
        recorded.append(set(last.issued))
    named = dict(reference.named_parameters())
    diff = max((named[n].detach() - p).abs().max().item() for n, p in _whole(model).items())
    experts = [p for n, p in model.named_parameters() if "experts" in n]
    expert_state = [
        v
        for p in experts
        for v in opt_ours.state[p].values()
        if isinstance(v, torch.Tensor) and v.dim()
    ]
    whole_experts = sum(p.numel() for n, p in reference.named_parameters() if "experts" in n)
    return {
        "loss": max(loss_errors),
        "params": diff,
        "planned": sorted(planned),
        "recorded": [sorted(r) for r in recorded],
        "expert_share": _local_numel(experts) / whole_experts,
        "state_share": _local_numel(expert_state) / whole_experts,
        "state_kinds": len({id(v) for v in expert_state}) // max(len(experts), 1),
        "replicas": replicas,
        "summary": model.step_summary() if not pipelined else "",
        "pipelined": pipelined,
        "held_layers": sorted(
            n.split(".")[2] for n, _ in model.named_parameters() if n.endswith("gate_up_proj")
        ),
    }


#: (mesh, strategies, model, optimizer)
CASES = [
    ("ep2xdp2", ["ep", "zero3"], "mixtral", "adamw"),
    ("ep2xdp2", ["ep", "zero3"], "mixtral", "sgd"),
    ("ep2xdp2", ["ep", "zero3"], "qwen3_moe", "adamw"),
    ("ep2xdp2", ["ep", "zero3"], "qwen3_moe", "sgd"),
    ("ep4", ["ep"], "mixtral", "sgd"),
    ("ep4", ["ep"], "qwen3_moe", "adamw"),
]
MESHES = {"ep2xdp2": {"dp_shard": 2, "ep": 2}, "ep4": {"ep": 4}}


def _key(case: tuple[Any, ...]) -> str:
    return "/".join(str(c) for c in case)


def _checkpoint(path: str, strategies: list[str], save: bool) -> dict[str, torch.Tensor]:
    """Mixtral under ``strategies``: trained 2 steps and saved through DCP, or a fresh one
    (other weights) loaded from that checkpoint."""
    import torch.distributed.checkpoint as dcp

    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    model = lamina.distribute(
        mixtral(seed=3 if save else 4, router_loss=True), strategies, example_inputs=(x,)
    )
    if save:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    else:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    return {n: t.clone() for n, t in _whole(model).items()}


def _refusals() -> dict[str, str]:
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    tries = {
        "divide": lambda: lamina.distribute(mixtral(experts=6), "ep", example_inputs=(x,)),
        "dense": lambda: lamina.distribute(
            nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)), "ep", example_inputs=(x,)
        ),
        "dispatcher": lambda: lamina.distribute(
            mixtral(), "ep", example_inputs=(x,), dispatcher="deep"
        ),
    }
    said = {}
    for name, attempt in tries.items():
        try:
            attempt()
        except ConfigError as error:
            said[name] = str(error)
    return said


def _job(path: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mesh in ("ep4", "ep2xdp2"):
        lamina.init(mesh=MESHES[mesh])
        for case in CASES:
            if case[0] == mesh:
                results[_key(case)] = _train(*case[1:])
        # saved under ep=4, loaded under ep=2 x dp_shard=2
        strategies = ["ep"] if mesh == "ep4" else ["ep", "zero3"]
        results[f"checkpoint/{mesh}"] = _checkpoint(path, strategies, save=mesh == "ep4")
        if mesh == "ep4":
            results["refusals"] = _refusals()
        lamina.shutdown()
    return results


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ep_checkpoint"))


@pytest.fixture(scope="module")
def results(checkpoint_path: str) -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_job, 4, args=(checkpoint_path,), env=env, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_expert_parallel_trains_as_one_process(
    results: list[dict[str, Any]], case: tuple[Any, ...]
) -> None:
    for rank, by_case in enumerate(results):
        got = by_case[_key(case)]
        assert got["loss"] <= 1e-6, (rank, got)
        assert got["params"] <= 1e-5, (rank, got)
        assert got["replicas"] == 4, got
        assert any(n.startswith("moe.0.tokens") for n in got["planned"]), got["planned"]
        assert "moe.aux_counts" in got["planned"], got["planned"]
        for recorded in got["recorded"]:
            assert recorded == got["planned"], (rank, recorded, got["planned"])


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_each_rank_holds_its_share_of_the_experts(
    results: list[dict[str, Any]], case: tuple[Any, ...]
) -> None:
    for by_case in results:
        got = by_case[_key(case)]
        # ep=4, or ep=2 with zero3 over 2 more: a quarter of every expert weight, and of
        # each of the optimizer's per-parameter states (AdamW: 2; SGD: none)
        assert got["expert_share"] == pytest.approx(0.25, abs=1e-9), got["expert_share"]
        kinds = 2 if case[3] == "adamw" else 0
        assert got["state_share"] == pytest.approx(0.25 * kinds, abs=1e-9), got


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", [CASES[4], CASES[0]], ids=_key)
def test_step_summary_shows_the_expert_load(
    results: list[dict[str, Any]], case: tuple[Any, ...]
) -> None:
    summary = results[0][_key(case)]["summary"]
    ep = 4 if case[0] == "ep4" else 2
    assert summary.startswith(f"expert parallelism over ep={ep}, dispatcher 'all_to_all'"), summary
    loads = [line for line in summary.splitlines() if "load (this rank's assignments" in line]
    assert len(loads) == 2, summary
    counts = [int(c) for c in loads[0].split("[")[1].split("]")[0].split(",")]
    assert sum(counts) == BATCH * SEQ * 2, loads  # every token's top-2, counted once
    if case[0] != "ep4":  # the sharder's summary follows
        assert "planned collectives" in summary, summary


@pytest.mark.timeout(700)
def test_a_checkpoint_loads_across_ep_degrees_and_in_one_process(
    results: list[dict[str, Any]], checkpoint_path: str
) -> None:
    import torch.distributed.checkpoint as dcp

    saved, loaded = results[0]["checkpoint/ep4"], results[0]["checkpoint/ep2xdp2"]
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
    one = mixtral(seed=5, router_loss=True)
    state = {"model": one.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_path)
    one.load_state_dict(state["model"])
    for name, p in one.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


@pytest.mark.timeout(700)
def test_what_ep_cannot_take_is_one_line_before_any_collective(
    results: list[dict[str, Any]],
) -> None:
    said = results[0]["refusals"]
    for message in said.values():
        assert "\n" not in message, message
    assert "6 experts do not split over ep=4 ranks" in said["divide"], said
    assert said["dense"].startswith("strategy 'ep' found no Mixture-of-Experts layer"), said
    assert "deep" in said["dispatcher"], said


#: 8 ranks: ep beside tp (tp splits attention, ep the experts, zero3 shards the rest)
CASES_8 = [
    ("tp", ["tp", "ep", "zero3"], "mixtral", "adamw"),
    ("tp", ["tp", "ep", "zero3"], "qwen3_moe", "sgd"),
    ("pp", ["pp", "ep", "zero3"], "mixtral", "sgd"),
    ("pp", ["pp", "ep", "zero3"], "qwen3_moe", "adamw"),
]
MESHES_8 = {"tp": {"dp_shard": 2, "ep": 2, "tp": 2}, "pp": {"pp": 2, "dp_shard": 2, "ep": 2}}


def _job_8() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mesh in MESHES_8:
        lamina.init(mesh=MESHES_8[mesh])
        for case in CASES_8:
            if case[0] == mesh:
                results[_key(case)] = _train(*case[1:])
        lamina.shutdown()
    return results


@pytest.fixture(scope="module")
def results_8() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_job_8, 8, env=env, timeout=900)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("case", CASES_8, ids=_key)
def test_ep_composed_with_tp_and_pp_trains_as_one_process(
    results_8: list[dict[str, Any]], case: tuple[Any, ...]
) -> None:
    for rank, by_case in enumerate(results_8):
        got = by_case[_key(case)]
        assert got["loss"] <= 1e-6, (rank, got)
        assert got["params"] <= 1e-5, (rank, got)
        assert got["replicas"] == 4, got
        if not got["pipelined"]:
            for recorded in got["recorded"]:
                assert recorded == got["planned"], (rank, recorded, got["planned"])
            continue
        # a stage exchanges the tokens of its own MoE layers only, and syncs once a step
        recorded = set(got["recorded"][-1])
        assert recorded <= set(got["planned"]), (rank, recorded)
        layers = {n.split(".")[1] for n in recorded if n.startswith("moe.")}
        assert layers == set(got["held_layers"]) and layers, (rank, layers, got["held_layers"])


def _traced_job() -> None:
    lamina.init(mesh={"ep": 4})
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    xs = torch.randint(0, VOCAB, (3, BATCH, SEQ), generator=g)
    model = lamina.distribute(mixtral(seed=0, router_loss=True), "ep", example_inputs=(xs[0],))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    lamina.shutdown()


@pytest.mark.timeout(300)
def test_trace_report_shows_each_ranks_expert_load(tmp_path: Any) -> None:
    from rich.console import Console

    from lamina.cli.trace import render_report
    from lamina.trace.analysis import build_report
    from lamina.trace.events import read_dir

    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu"), "LAMINA_TRACE": str(tmp_path)}
    run_ranks(_traced_job, 4, env=env, timeout=240)
    report = build_report(read_dir(tmp_path), str(tmp_path))
    loads = [load for load in report.experts if load.step > 0]
    assert {(load.step, load.layer) for load in loads} == {
        (s, k) for s in (1, 2, 3) for k in (0, 1)
    }
    hidden = 32 * 4  # Mixtral's hidden size, float32
    for load in loads:
        assert sorted(load.sent) == sorted(load.computed) == [0, 1, 2, 3], load
        # every rank sends each of its tokens' top-2 assignments once; every assignment is
        # computed once, by the rank holding its expert
        assert sum(load.sent.values()) == 4 * BATCH * SEQ * 2 * hidden, load
        assert sum(load.computed.values()) == sum(load.sent.values()), load
        assert load.imbalance >= 1.0
    console = Console(width=160, record=True)
    render_report(report, console)
    text = console.export_text()
    assert "expert load (bytes each rank's experts computed" in text, text
    assert "MoE layer 1: step 3:" in text, text


def test_the_simulator_prices_an_ep_step_as_its_compute_then_its_exchanges() -> None:
    from lamina.runtime.render import EXPERT_STEP
    from lamina.simulate import cluster_from_dict, predict
    from lamina.strategies.ep.find import MoeLayer
    from lamina.strategies.ep.plan_nodes import ExpertPlanInput, PlanGroup, build_expert_plan

    layers = tuple(MoeLayer(f"layers.{i}.experts", 8, 256, 512, 2, tokens=256) for i in range(2))
    everyone = PlanGroup((0, 1, 2, 3), "ep")
    plan = build_expert_plan(
        ExpertPlanInput(
            layers,
            everyone,
            everyone,
            PlanGroup((0,), ""),
            everyone,
            {"float32": 650_000},
            {"float32": 6_000_000},
            (),
            4,
            "gloo",
        ),
        meta=((EXPERT_STEP, "0.12"),),
    )
    cluster = cluster_from_dict(
        {
            "hosts": 2,
            "devices_per_host": 2,
            "intra": {"bandwidth_gbps": 1.0, "latency_us": 500},
            "inter": {"bandwidth_gbps": 0.025, "latency_us": 100},
            "mesh": {"ep": 4},
        }
    )
    predicted = predict(plan, cluster)
    assert predicted.expert is not None and predicted.expert.compute_s == pytest.approx(0.12)
    assert predicted.step_s == pytest.approx(0.12 + predicted.total_s)
    tokens = [c for c in predicted.per_step if c.node == "moe.0.tokens"]
    assert tokens and tokens[0].op == "all_to_all" and tokens[0].nbytes == 256 * 2 * 256 * 4
    # across the hosts: 2 of the 3 peers sit behind the uplink both ranks of a host share
    assert tokens[0].link_seconds("inter") > tokens[0].link_seconds("intra") > 0
    assert "expert parallel on ep: compute 120.0 ms" in predicted.report()
