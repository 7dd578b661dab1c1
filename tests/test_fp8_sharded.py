"""fp8 gradients in the sharded strategies: ZeRO-3's reduce-scatter and HSDP's all-reduce
across the replicas, beside torch DDP, and the fallback a flagged unit takes on every
rank in the same step. 4 gloo ranks laid out as 2 hosts x 2, interleaved (the
``inter`` x ``intra`` mesh from the topology)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import lamina
from lamina.comm.codecs import Fp8Codec
from lamina.errors import ConfigError
from lamina.testing import run_ranks
from lamina.trace import recorder
from models_for_tests import batch, build, loss_of
from test_dp_algorithms import STEPS, _train_beside_ddp
from test_fp8_dp import OVERFLOW_STEP, relative_drift
from topologies_for_tests import two_hosts_interleaved

pytestmark = pytest.mark.multiprocess

WORLD = 4


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [v.full_tensor() for v in model.state_dict().values()]


def _against_ddp(strategy: str, rank: int) -> dict[str, Any]:
    initial = build("gpt", seed=rank)
    trace = recorder.start(recorder.TraceRecorder(rank, WORLD))
    try:
        ours = lamina.distribute(copy.deepcopy(initial), strategy, codec="fp8", min_unit_numel=0)
        ddp = _train_beside_ddp(ours, initial, rank)
        events = [e for e in trace.events() if e.codec is not None]
    finally:
        recorder.stop(write=False)
    full = _full(ours)
    plan = ours.execution_plan
    return {
        "drift": relative_drift(full, ddp),
        "full": [t.clone() for t in full],
        "compressed": sorted(
            {n.id.rsplit(".", 1)[-1] for n in plan.collectives() if n.attr("codec")}
        ),
        "error_feedback_bytes": int(dict(plan.meta).get("error_feedback_bytes", 0)),
        "roles": sorted({e.codec["role"] for e in events}),
        "used": all(e.codec["used"] for e in events),
        "fallbacks": len(ours.run_log.events),
    }


def _overflow(rank: int) -> dict[str, Any]:
    """ZeRO-3 with a low overflow bound: rank 1's loss is scaled past it at one step."""
    model = lamina.distribute(
        build("gpt", seed=0), "zero3", codec=Fp8Codec(overflow_at=1e3), min_unit_numel=0
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    for step in range(STEPS):
        x, y = batch("gpt", step, rank)
        scale = 1e6 if step == OVERFLOW_STEP and rank == 1 else 1.0
        (scale * loss_of("gpt", model(x), y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    scatters = [n for n in model.execution_plan.collectives() if n.id.endswith("reduce_scatter")]
    return {
        "full": _full(model),
        "steps": sorted({e.step for e in model.run_log.events}),
        "events": len(model.run_log.events),
        "units": len(scatters),
    }


def _job() -> dict[str, Any]:
    runtime = lamina.init(mesh="topology")
    try:
        lamina.distribute(build("mlp", seed=0), "zero3", codec="bf16")
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    return {
        "zero3": _against_ddp("zero3", runtime.rank),
        "hsdp": _against_ddp("hsdp", runtime.rank),
        "overflow": _overflow(runtime.rank),
        "refused": refused,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path: Path = tmp_path_factory.mktemp("fp8-sharded") / "interleaved.json"
    path.write_text(json.dumps(two_hosts_interleaved()))
    return run_ranks(_job, WORLD, env={"LAMINA_TOPOLOGY": str(path)}, timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("strategy", "compressed"), [("zero3", "reduce_scatter"), ("hsdp", "replicas")]
)
def test_sharded_fp8_trains_like_ddp_on_every_rank(
    results: list[dict[str, Any]], strategy: str, compressed: str
) -> None:
    for rank, result in enumerate(results):
        ours = result[strategy]
        for a, b in zip(ours["full"], results[0][strategy]["full"], strict=True):
            assert torch.equal(a, b), rank
        assert ours["drift"] < 0.1, (rank, ours["drift"])  # e4m3 under AdamW, as in dp
        assert ours["compressed"] == [compressed]
        assert ours["error_feedback_bytes"] > 0 and ours["used"] and ours["fallbacks"] == 0
    roles = {"zero3": ["scatter"], "hsdp": ["replicate"]}[strategy]
    assert results[0][strategy]["roles"] == roles


@pytest.mark.timeout(360)
def test_a_flagged_unit_falls_back_on_every_rank_in_the_same_step(
    results: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(results):
        overflow = result["overflow"]
        assert overflow["steps"] == [OVERFLOW_STEP + 1], rank  # step 0: the setup
        assert overflow["events"] == overflow["units"], rank
        for a, b in zip(overflow["full"], results[0]["overflow"]["full"], strict=True):
            assert torch.equal(a, b), rank


@pytest.mark.timeout(360)
def test_cast_codecs_are_refused_by_the_sharded_strategies(
    results: list[dict[str, Any]],
) -> None:
    assert "zero3 and hsdp compress gradients with 'fp8'" in results[0]["refused"]
