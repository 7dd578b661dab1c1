"""Pipeline parallelism (``pp``): the chain of blocks cut into stages, each schedule
training as one process does on pp=2 x dp=2, pp=2 x zero3=2, pp=4 and pp=2 x tp=2 x dp=2
(tensor parallelism inside the stages, ZeRO-3 or replicas over dp), the pre-flight check
naming a send whose recv does not match, and DCP checkpoints resumed on another pipeline
degree."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import lamina
from lamina.errors import ConfigError, VerificationError
from lamina.strategies.pp.chain import find_chain
from lamina.strategies.pp.cut import BlockCosts, cut_stages, measure_costs
from lamina.strategies.pp.schedules import bubble_fraction, schedule_kind
from lamina.testing import run_ranks
from models_for_tests import GPT, GPTConfig, tiny_llama
from modern_models import fused_llama, qwen3, qwen3_moe

pytestmark = [pytest.mark.multiprocess]

#: Below every step's gradient norm of both models, so clipping scales every step.
MAX_NORM = 0.05
VOCAB, BATCH, SEQ, LAYERS = 64, 8, 16, 8
STEPS = 5


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _build(name: str, width: int = 32) -> nn.Module:
    """The GPT example (tied embedding and head), a Hugging Face Llama, or a model in
    today's styles (:mod:`modern_models`: the fused Llama with its blocks in a
    ``ModuleDict``, Qwen3, Qwen3-MoE), 8 blocks (4 for today's models)."""
    if name == "gpt":
        config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=width, n_layers=LAYERS, n_heads=4)
        return GPT(config)
    if name == "fused":
        return fused_llama(0, layers=4, dim=32, hidden=64)
    if name == "qwen3":
        return qwen3(0, layers=4)
    if name == "moe":
        return qwen3_moe(0, layers=4)
    return tiny_llama(0, num_hidden_layers=LAYERS)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    from _gpt_model import lm_loss

    return lm_loss(_logits(out), target)


def _train_once(
    runtime: Any, name: str, schedule: str, optimizer: str, strategy: Any = "pp"
) -> dict[str, Any]:
    """5 steps of ``name`` pipelined (with ``strategy``: ``"pp"``, or ``["pp", "zero3"]``
    sharding the stages over ``dp``), against the same model trained in this process on
    every replica's batch (the same microbatches)."""
    torch.manual_seed(0)
    reference = _build(name)
    torch.manual_seed(0)
    ours = _build(name)
    if runtime.rank:  # rank-seeded weights: the setup broadcast makes them rank 0's
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(torch.randn_like(p))
    axes = runtime.mesh.axis_names
    replicas = runtime.mesh.size("dp") if "dp" in axes else 1
    replica = runtime.mesh.coordinates().get("dp", 0)
    xs = [_ids(10 + k) for k in range(STEPS * replicas)]
    ys = [_ids(100 + k) for k in range(STEPS * replicas)]
    # one timed run per block: the cut's timing is not what these tests check
    ours = lamina.distribute(
        ours, strategy, example_inputs=(xs[0],), schedule=schedule, timing_runs=1
    )

    def make(params: Any) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-3)

    opt_ref, opt_ours = make(reference.parameters()), make(ours.parameters())
    loss_errors, norm_errors = [], []
    for step in range(STEPS):
        batch = range(step * replicas, (step + 1) * replicas)
        parts = [_loss(reference(xs[k]), ys[k]) for k in batch]
        (sum(parts) / replicas).backward()
        k = step * replicas + replica
        loss = ours.step(xs[k], ys[k], _loss)  # type: ignore[operator]
        # clipped at a bound below every step's norm: the whole model's norm as one
        # process computes it, and every stage's gradients scaled by it
        want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        norm = ours.clip_grad_norm_(MAX_NORM)  # type: ignore[operator]
        assert want_norm.item() > MAX_NORM, "the bound must clip"
        norm_errors.append(abs(norm.item() - want_norm.item()) / want_norm.item())
        for opt in (opt_ref, opt_ours):
            opt.step()
            opt.zero_grad(set_to_none=True)
        want = parts[replica].item()
        loss_errors.append(abs(loss.item() - want) / abs(want))
    named = reference.state_dict()
    mine = {  # a shard's or a tp slice's whole tensor: gathered over the ranks holding it
        n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in ours.state_dict().items()
    }
    diff = max((named[n] - t).abs().max().item() for n, t in mine.items())
    plan = ours.execution_plan  # type: ignore[union-attr]
    phases = ours.lamina_pp.engine.last_phases  # type: ignore[union-attr]
    # attention split by heads where tp holds a stage: its projections cut on their rows
    # in the placement, each rank holding half of them
    placement = ours.placement  # type: ignore[union-attr]
    local = dict(ours.named_parameters())
    attention = {
        n: (placement.of(n).describe(), _rows(local[n]), named[n].shape[0])
        for n in local
        if n.endswith(("wqkv.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight"))
    }
    return {
        "loss": max(loss_errors),
        "norm": max(norm_errors),
        "params": diff,
        "stages": ours.stages,  # type: ignore[union-attr]
        "strategy": plan.strategy,
        "names": sorted(n for n, _ in ours.named_parameters(remove_duplicate=False)),
        "phases": (phases.schedule_s, phases.compute_s, phases.gradient_sync_s),
        "attention": attention,
    }


def _rows(param: torch.Tensor) -> int:
    """Rows of this rank's piece before any sharding over dp (a shard's whole slice)."""
    return int((param.full_tensor() if isinstance(param, DTensor) else param).shape[0])


def _save(name: str, directory: str, strategy: Any = "pp") -> dict[str, torch.Tensor]:
    """Train one step pipelined, save through DCP; this rank's parameters as saved (whole:
    a zero3 shard gathered over its stage's ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.manual_seed(1)
    model = lamina.distribute(_build(name), strategy, example_inputs=(_ids(1),), timing_runs=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.step(_ids(2), _ids(3), _loss)  # type: ignore[operator]
    opt.step()
    dcp.save(get_model_state_dict(model), checkpoint_id=directory)
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.state_dict().items()
    }


def _load(name: str, directory: str) -> dict[str, Any]:
    """A fresh pipelined model (other weights) loaded from ``directory``: its state, and
    what calling it directly says."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(7)
    model = lamina.distribute(_build(name), "pp", example_inputs=(_ids(1),), timing_runs=1)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state)
    loaded = {n: p.detach().clone() for n, p in model.state_dict().items()}
    try:
        model(_ids(1))
    except ConfigError as err:
        return {"loaded": loaded, "direct_call": str(err)}
    return {"loaded": loaded, "direct_call": "no error"}


#: (model, schedule, optimizer): each schedule on both models over the two layouts.
PP_DP_CASES = [
    ("gpt", "1f1b", "sgd"),
    ("gpt", "zbv", "adamw"),
    ("llama", "gpipe", "adamw"),
    ("llama", "interleaved1f1b", "sgd"),
]
#: Each schedule once with the stages sharded by ZeRO-3 over dp (both models, both optimizers).
PP_ZERO3_CASES = [
    ("gpt", "gpipe", "adamw"),
    ("gpt", "interleaved1f1b", "sgd"),
    ("llama", "1f1b", "sgd"),
    ("llama", "zbv", "adamw"),
]
#: On pp=2 x dp=2 x tp=2 (8 ranks): 3-D (tensor parallelism inside each stage, the
#: stages sharded by ZeRO-3 over dp) and pp x tp replicated over dp, each on both models,
#: and pp x hsdp (sharded over tp's axis, replicated over dp); every schedule, both
#: optimizers.
PP_TP_CASES = [
    (("pp", "tp", "zero3"), "llama", "zbv", "adamw"),
    (("pp", "tp", "zero3"), "gpt", "1f1b", "sgd"),
    (("pp", "tp"), "gpt", "interleaved1f1b", "sgd"),
    (("pp", "tp"), "llama", "gpipe", "sgd"),
    (("pp", "hsdp"), "gpt", "1f1b", "adamw"),
]
PP4_CASES = [
    ("gpt", "interleaved1f1b", "adamw"),
    ("gpt", "gpipe", "sgd"),
    ("llama", "1f1b", "adamw"),
    ("llama", "zbv", "sgd"),
]


def _pp_dp_job(directory: str) -> dict[str, Any]:
    runtime = lamina.init(mesh={"pp": 2, "dp": 2})
    out: dict[str, Any] = {f"{n}/{s}/{o}": _train_once(runtime, n, s, o) for n, s, o in PP_DP_CASES}
    for n, s, o in PP_ZERO3_CASES:
        out[f"zero3/{n}/{s}/{o}"] = _train_once(runtime, n, s, o, ["pp", "zero3"])
    out["saved"] = _save("gpt", f"{directory}/pp_dp")
    out["saved_zero3"] = _save("gpt", f"{directory}/pp_zero3", ["pp", "zero3"])
    lamina.shutdown()
    return out


def _pp_tp_job(directory: str) -> dict[str, Any]:
    runtime = lamina.init(mesh={"pp": 2, "dp": 2, "tp": 2})
    out: dict[str, Any] = {
        f"{'+'.join(c)}/{n}/{s}/{o}": _train_once(runtime, n, s, o, list(c))
        for c, n, s, o in PP_TP_CASES
    }
    out["saved"] = _save("gpt", f"{directory}/pp_tp_zero3", ["pp", "tp", "zero3"])
    lamina.shutdown()
    return out


def _pp4_job(directory: str) -> dict[str, Any]:
    runtime = lamina.init(mesh={"pp": 4})
    out: dict[str, Any] = {f"{n}/{s}/{o}": _train_once(runtime, n, s, o) for n, s, o in PP4_CASES}
    out |= _load("gpt", f"{directory}/pp_dp")
    out["loaded_zero3"] = _load("gpt", f"{directory}/pp_zero3")["loaded"]
    out["loaded_3d"] = _load("gpt", f"{directory}/pp_tp_zero3")["loaded"]
    lamina.shutdown()
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where pp=2 x dp=2 (``pp_dp/``) and pp=2 x zero3=2 (``pp_zero3/``) save."""
    return tmp_path_factory.mktemp("pp_checkpoint")


@pytest.fixture(scope="module")
def pp_dp_results(checkpoint_dir: Path) -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_pp_dp_job, 4, args=(str(checkpoint_dir),), env=env, timeout=600)


@pytest.fixture(scope="module")
def pp_tp_results(checkpoint_dir: Path) -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_pp_tp_job, 8, args=(str(checkpoint_dir),), env=env, timeout=600)


@pytest.fixture(scope="module")
def pp4_results(
    pp_dp_results: list[dict[str, Any]],
    pp_tp_results: list[dict[str, Any]],
    checkpoint_dir: Path,
) -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_pp4_job, 4, args=(str(checkpoint_dir),), env=env, timeout=600)


def _check(results: list[dict[str, Any]], key: str, strategy: str = "pp") -> None:
    for rank, result in enumerate(results):
        got = result[key]
        assert got["loss"] <= 1e-6, (rank, key, got["loss"])
        assert got["params"] <= 1e-5, (rank, key, got["params"])
        assert got["norm"] <= 1e-6, (rank, key, got["norm"])
        assert got["strategy"] == strategy


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("name", "schedule", "optimizer"), PP_DP_CASES)
def test_pp_by_dp_trains_as_one_process(
    pp_dp_results: list[dict[str, Any]], name: str, schedule: str, optimizer: str
) -> None:
    key = f"{name}/{schedule}/{optimizer}"
    _check(pp_dp_results, key)
    per_rank = [r[key]["stages"] for r in pp_dp_results]
    virtual = 2 if schedule in ("zbv", "interleaved1f1b") else 1
    assert all(len(s) == virtual for s in per_rank)
    # the two pipelines (mesh rows) hold the same stages: pp is the first axis
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3] != per_rank[0]
    for result in pp_dp_results:  # the step's phases, timed: the stages' chunks inside
        schedule_s, compute_s, sync_s = result[key]["phases"]
        assert 0 < compute_s < schedule_s and sync_s > 0, result[key]["phases"]


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("name", "schedule", "optimizer"), PP_ZERO3_CASES)
def test_pp_by_zero3_trains_as_one_process(
    pp_dp_results: list[dict[str, Any]], name: str, schedule: str, optimizer: str
) -> None:
    """Each rank's stages sharded over dp, gathered once per step for every microbatch."""
    key = f"zero3/{name}/{schedule}/{optimizer}"
    _check(pp_dp_results, key, strategy="pp+zero3")
    for result in pp_dp_results:
        assert all(isinstance(n, str) and not n.startswith("_") for n in result[key]["names"])


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("strategies", "name", "schedule", "optimizer"), PP_TP_CASES)
def test_pp_by_tp_with_or_without_zero3_trains_as_one_process(
    pp_tp_results: list[dict[str, Any]],
    strategies: tuple[str, ...],
    name: str,
    schedule: str,
    optimizer: str,
) -> None:
    """pp=2 x dp=2 x tp=2: each stage's layers split over tp (tensor-parallel slices
    gathered whole for the comparison), the stages sharded over dp or replicated there."""
    label = "+".join(strategies)
    key = f"{label}/{name}/{schedule}/{optimizer}"
    _check(pp_tp_results, key, strategy=label)
    if "tp" in strategies and name != "gpt":
        check_attention_split(pp_tp_results, key)


def check_attention_split(results: list[dict[str, Any]], key: str) -> None:
    """Attention split by heads in each stage: every q/k/v (or fused ``wqkv``) weight cut
    on its rows across tp in the placement, each rank holding half of them."""
    for rank, result in enumerate(results):
        attention = result[key]["attention"]
        assert attention, (rank, key)
        for param, (placed, rows, whole) in attention.items():
            assert "tp: Split(0" in placed and rows * 2 == whole, (rank, param, placed)


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("name", "schedule", "optimizer"), PP4_CASES)
def test_pp4_trains_as_one_process(
    pp4_results: list[dict[str, Any]], name: str, schedule: str, optimizer: str
) -> None:
    key = f"{name}/{schedule}/{optimizer}"
    _check(pp4_results, key)
    stages = sorted(s for r in pp4_results for s in r[key]["stages"])
    assert stages == list(range(8 if schedule in ("zbv", "interleaved1f1b") else 4))
    names = [set(r[key]["names"]) for r in pp4_results]
    assert all(len(a & b) == 0 or "tok.weight" in a & b for a in names for b in names if a is not b)


def _check_loads_exactly(
    saved_by: list[dict[str, Any]], loaded_by: list[dict[str, Any]], saved_key: str,
    loaded_key: str, directory: Path,
) -> None:  # fmt: skip
    """Every pp=4 rank's stages loaded what the pp=2 ranks saved, exactly, and so did the
    whole model in one process (no process group: the full state dict)."""
    import torch.distributed.checkpoint as dcp

    saved: dict[str, torch.Tensor] = {}
    for result in saved_by:
        saved.update(result[saved_key])
    for rank, result in enumerate(loaded_by):
        assert result[loaded_key], rank
        for key, value in result[loaded_key].items():
            assert torch.equal(value, saved[key]), (rank, key)
    state = _build("gpt").state_dict()
    dcp.load(state, checkpoint_id=str(directory))
    assert set(state) == set(saved)
    for key, value in state.items():
        assert torch.equal(value, saved[key]), key


@pytest.mark.timeout(700)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_a_checkpoint_saved_under_pp2_by_dp2_loads_exactly_under_pp4_and_in_one_process(
    pp_dp_results: list[dict[str, Any]], pp4_results: list[dict[str, Any]], checkpoint_dir: Path
) -> None:
    _check_loads_exactly(pp_dp_results, pp4_results, "saved", "loaded", checkpoint_dir / "pp_dp")
    for result in pp4_results:
        assert result["direct_call"].startswith("a pipelined model runs whole steps: call loss")


@pytest.mark.timeout(700)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_a_checkpoint_of_zero3_sharded_stages_loads_exactly_under_pp4_and_in_one_process(
    pp_dp_results: list[dict[str, Any]], pp4_results: list[dict[str, Any]], checkpoint_dir: Path
) -> None:
    """pp=2 x zero3=2 saves each stage's shards through DCP under the model's names."""
    directory = checkpoint_dir / "pp_zero3"
    _check_loads_exactly(pp_dp_results, pp4_results, "saved_zero3", "loaded_zero3", directory)


@pytest.mark.timeout(700)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_a_3d_checkpoint_loads_exactly_under_pp4_and_in_one_process(
    pp_tp_results: list[dict[str, Any]], pp4_results: list[dict[str, Any]], checkpoint_dir: Path
) -> None:
    """pp=2 x tp=2 x zero3=2 saves each stage's whole-tensor views (tp slices of zero3
    shards) through DCP under the model's names."""
    directory = checkpoint_dir / "pp_tp_zero3"
    _check_loads_exactly(pp_tp_results, pp4_results, "saved", "loaded_3d", directory)


def _mismatch_job() -> str:
    runtime = lamina.init(mesh={"pp": 2})
    width = 32 if runtime.rank == 0 else 48  # the second stage's rank set another hidden size
    try:
        lamina.distribute(_build("gpt", width), "pp", example_inputs=(_ids(0),))
    except VerificationError as err:
        return str(err)
    finally:
        lamina.shutdown()
    return "no error"


@pytest.mark.timeout(300)
def test_a_send_whose_recv_does_not_match_is_named_on_every_rank_before_any_transfer() -> None:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    messages = run_ranks(_mismatch_job, 2, env=env, timeout=240)
    for message in messages:
        assert "\n" not in message
        assert "pipeline_transfers" in message, message
        assert "send stage 0 -> recv stage 1 (pipeline rank 0 -> 1): [2, 16, 32]" in message
        assert "[2, 16, 48]" in message


def test_the_chain_is_the_transformer_blocks_with_embeddings_before_and_head_after() -> None:
    model = _build("gpt")
    x = _ids(0)[:2]
    chain = find_chain(model, lambda: model(x))
    assert chain.container == "blocks" and len(chain.blocks) == LAYERS
    assert chain.prefix == ("tok", "pos") and chain.suffix == ("ln_f", "head")
    llama = _build("llama")
    chain = find_chain(llama, lambda: llama(x))
    assert chain.container == "model.layers" and chain.suffix[-1] == "lm_head"
    assert chain.entry_shapes[3] == (2, SEQ, 32)


def test_the_cut_balances_measured_costs_and_split_points_override_it() -> None:
    model = _build("gpt")
    x = _ids(0)[:2]
    chain = find_chain(model, lambda: model(x))
    costs = BlockCosts((1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0), rest=0.0)
    cut = cut_stages(chain, 2, costs)
    assert [(s.start, s.stop) for s in cut.spans] == [(0, 6), (6, 8)]
    assert cut.seconds == (6.0, 6.0) and cut.source == "measured"
    given = cut_stages(chain, 2, costs, ["blocks.4"])
    assert [(s.start, s.stop) for s in given.spans] == [(0, 4), (4, 8)]
    assert given.source == "split_points"
    with pytest.raises(ConfigError, match=r"'blocks\.nine' is not a block of blocks"):
        cut_stages(chain, 2, costs, ["blocks.nine"])
    with pytest.raises(ConfigError, match="need at least 9 blocks"):
        cut_stages(chain, 9, costs)


def test_a_v_schedules_cut_balances_each_ranks_stages_together() -> None:
    """ZBV's V puts stages 0 and 3 (the prefix, and the head's cost) on rank 0: the cut
    balances the ranks' sums, not each stage alone."""
    model = _build("gpt")
    x = _ids(0)[:2]
    chain = find_chain(model, lambda: model(x))
    costs = BlockCosts((1.0,) * 8, rest=4.0)
    alone = cut_stages(chain, 4, costs)
    assert [s.start for s in alone.spans] == [0, 2, 4, 7]  # rank 0 busy 2 + 5, rank 1 2 + 3
    v = cut_stages(chain, 4, costs, holders=[0, 1, 1, 0])
    assert [s.start for s in v.spans] == [0, 1, 2, 7]
    seconds = v.seconds
    assert seconds[0] + seconds[3] == seconds[1] + seconds[2] == 6.0
    assert cut_stages(chain, 2, costs, holders=[0, 1]).spans == cut_stages(chain, 2, costs).spans


def test_blocks_alike_are_timed_alike() -> None:
    """The GPT's 8 blocks are one kind: each costs their median, so that noise between
    equal blocks does not pick the cut."""
    model = _build("gpt")
    x = _ids(0)[:2]
    chain = find_chain(model, lambda: model(x))
    costs = measure_costs(model, chain, lambda: model(x), runs=1)
    assert len(costs.blocks) == 8 and len(set(costs.blocks)) == 1 and costs.blocks[0] > 0


def test_schedules_by_name_and_their_bubble() -> None:
    assert schedule_kind("1F1B").name == "1f1b"
    with pytest.raises(ConfigError, match="gpipe"):
        schedule_kind("dualpipe")
    assert bubble_fraction(schedule_kind("1f1b"), 4, 4, 1) == pytest.approx(3 / 7)
    interleaved = bubble_fraction(schedule_kind("interleaved1f1b"), 4, 4, 2)
    assert interleaved == pytest.approx(3 / 11)


@pytest.mark.parametrize(
    ("names", "fix"),
    [
        (["tp", "pp"], "['pp', 'tp']"),
        (["pp", "zero3", "tp"], "['pp', 'tp', 'zero3']"),
        (["hsdp", "pp"], "['pp', 'hsdp']"),
    ],
)
def test_strategies_composed_in_an_order_lamina_does_not_run_are_one_line(
    names: list[str], fix: str
) -> None:
    from lamina.strategies.compose import check_order
    from lamina.strategies.registry import get_strategy

    with pytest.raises(ConfigError) as err:
        check_order([get_strategy(n) for n in names])
    message = str(err.value)
    assert "\n" not in message and str(names) in message
    assert fix in message  # the order that composes


def test_a_model_without_a_chain_of_blocks_is_one_line() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"nn\.ModuleDict or other container") as err:
        find_chain(model, lambda: model(torch.randn(2, 4)))
    assert "\n" not in str(err.value)


def _traced_job() -> None:
    lamina.init(mesh={"pp": 2})
    model = lamina.distribute(_build("gpt"), "pp", example_inputs=(_ids(0),), schedule="1f1b")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model.step(_ids(step), _ids(step + 10), _loss)  # type: ignore[operator]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    lamina.shutdown()


@pytest.mark.timeout(300)
def test_the_trace_report_shows_each_ranks_schedule_compute_bubble_and_sync(
    tmp_path: Path,
) -> None:
    from rich.console import Console

    from lamina.cli.trace import render_report
    from lamina.trace.analysis import build_report
    from lamina.trace.events import read_dir
    from lamina.trace.export import chrome_trace

    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu"), "LAMINA_TRACE": str(tmp_path)}
    run_ranks(_traced_job, 2, env=env, timeout=240)
    traces = read_dir(tmp_path)
    report = build_report(traces, str(tmp_path))
    rows = report.pipeline
    assert sorted({(r.rank, r.step) for r in rows}) == [(k, s) for k in (0, 1) for s in (1, 2, 3)]
    for row in rows:  # the stages' chunks inside the schedule, the sync after it
        assert 0 < row.compute_ns < row.schedule_ns and row.sync_ns > 0, row
        assert 0 < row.bubble < 1, row
    console = Console(width=120, record=True)
    render_report(report, console)
    text = console.export_text()
    assert "pipeline per step and rank" in text and "gradient sync" in text, text
    chunks = {e["name"] for e in chrome_trace(traces)["traceEvents"] if e.get("cat") == "compute"}
    assert {"stage 0 forward", "stage 0 backward", "stage 1 forward", "stage 1 backward"} <= chunks


def _pipeline_plan() -> Any:
    lamina.init(mesh={"pp": 2})
    model = lamina.distribute(_build("gpt"), "pp", example_inputs=(_ids(0),), schedule="1f1b")
    plan = model.execution_plan  # type: ignore[union-attr]
    held = sum(p.numel() for p in model.parameters())
    zbv = lamina.distribute(_build("gpt"), "pp", example_inputs=(_ids(0),), schedule="zbv")
    lamina.shutdown()
    return plan, held, zbv.execution_plan  # type: ignore[union-attr]


def _even_stages(plan: Any, seconds: float) -> Any:
    """``plan`` with every stage taking ``seconds`` per microbatch (1/3 forward)."""
    import dataclasses

    from lamina.runtime.nodes import Compute

    def even(node: Any) -> Any:
        detail = node.detail
        if not isinstance(detail, Compute) or detail.seconds is None:
            return node
        share = seconds / 3 if node.kind == "forward" else 2 * seconds / 3
        return dataclasses.replace(node, detail=dataclasses.replace(detail, seconds=share))

    return dataclasses.replace(plan, nodes=tuple(even(n) for n in plan.nodes))


@pytest.mark.timeout(300)
def test_the_simulator_runs_the_plans_schedule_with_its_bubble_and_transfers() -> None:
    from lamina.simulate import cluster_from_dict, predict

    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    results = run_ranks(_pipeline_plan, 2, env=env, timeout=240)
    plan = results[0][0]
    measured = [n.detail.seconds for n in plan.nodes if n.kind == "forward"]
    assert len(measured) == 2 * 4 and all(s > 0 for s in measured)  # 2 stages x 4 mbs

    def cluster(gbit: float) -> Any:
        return cluster_from_dict(
            {
                "hosts": 2,
                "devices_per_host": 1,
                "intra": {"kind": "nvlink", "bandwidth_gbps": 450, "latency_us": 3},
                "inter": {"kind": "ib", "bandwidth_gbit": gbit, "latency_us": 5},
                "mesh": {"pp": 2},
            },
            "cluster.json",
        )

    even = _even_stages(plan, 0.3)
    fast = predict(even, cluster(1e6)).pipeline
    assert fast is not None and fast.schedule == "1f1b" and fast.microbatches == 4
    # 1F1B, p = 2, m = 4, equal stages, free links: (m + p - 1) x 0.3 s, bubble 1/5
    assert fast.schedule_s == pytest.approx(1.5, rel=1e-3)
    assert fast.bubble == pytest.approx(0.2, abs=1e-3)
    slow = predict(even, cluster(0.001))  # 1 Mbit/s: 4 KiB take ~33 ms
    assert slow.pipeline is not None and slow.pipeline.transfer_s > 0.02
    # the first activation and the last gradient wait on the link: two transfers
    added = slow.pipeline.schedule_s - fast.schedule_s
    assert added == pytest.approx(2 * slow.pipeline.transfer_s, rel=0.02), slow.pipeline
    assert slow.step_s == pytest.approx(slow.pipeline.schedule_s + slow.total_s)
    assert "pipeline schedule (1f1b, 4 microbatches" in slow.report()
    # memory: each rank its stages' parameters, the largest rank's counted
    assert slow.memory.local_elements == max(held for _, held, _ in results)
    assert slow.memory.param_elements == sum(p.numel() for p in _build("gpt").parameters())
    assert "the largest pipeline rank's stages" in slow.report()
    # ZBV: each backward's weight half fills the gaps; 4 stages of 0.3 s, 2 per rank,
    # m = 4: 2.4 s of compute per rank in 2.5 s, as torch's own ZBV timetable for p = 2,
    # m = 4 has one idle slot in 25 (forward, input and weight gradient a slot each)
    zbv = predict(_even_stages(results[0][2], 0.3), cluster(1e6)).pipeline
    assert zbv is not None and zbv.schedule == "zbv"
    assert zbv.schedule_s == pytest.approx(2.5, rel=1e-3)
    assert zbv.bubble == pytest.approx(0.04, abs=1e-3)
