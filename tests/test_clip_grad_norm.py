"""``clip_grad_norm_`` on every strategy and composition, read from the model's placement:
the one-process norm on every rank, and parameters after clipped steps as one process's
(pipelines: tests/test_pipeline.py clips the same way). Also the placement model itself
and the composition order that follows from the strategies' roles."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import lamina
from lamina.errors import ConfigError
from lamina.runtime.placement import (
    ModelPlacement,
    Replicate,
    Role,
    Shard,
    Split,
    Stage,
)
from lamina.testing import run_ranks
from models_for_tests import tiny_gpt, tiny_llama

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, ROWS, STEPS = 64, 16, 2, 5
#: Below every model's gradient norm here (0.9-1.6 at the first step), so every step clips.
MAX_NORM = 0.05


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_gpt() if name == "gpt" else tiny_llama(0)


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, under its own name (collective: shards and tp slices are
    gathered through the state dict's DTensors)."""
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for n, t in model.state_dict().items()
    }


def _clipped_run(name: str, strategy: Any, norm_type: float = 2.0) -> dict[str, Any]:
    """5 SGD steps, each clipped at :data:`MAX_NORM`, of ``name`` under ``strategy``
    against the same model in this process on every replica's batch."""
    from _gpt_model import lm_loss

    reference, ours = _build(name), _build(name)
    if strategy in ("dp", "zero3", "hsdp"):
        ours = lamina.distribute(ours, strategy)
    else:
        ours = lamina.distribute(ours, strategy, example_inputs=(_ids(0),))
    replica = ours.data_replica  # type: ignore[union-attr]
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    norm_errors, clipped = [], []
    for step in range(STEPS):
        batches = [
            (step * replica.count + k, step * replica.count + k + 500) for k in range(replica.count)
        ]
        parts = [lm_loss(_logits(reference, _ids(x)), _ids(y)) for x, y in batches]
        (sum(parts) / replica.count).backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type)
        x, y = batches[replica.index]
        lm_loss(_logits(ours, _ids(x)), _ids(y)).backward()
        got = ours.clip_grad_norm_(MAX_NORM, norm_type)  # type: ignore[operator]
        norm_errors.append(abs(got.item() - want.item()) / want.item())
        clipped.append(want.item() > MAX_NORM)
        for opt in (opt_ref, opt_ours):
            opt.step()
            opt.zero_grad(set_to_none=True)
    named = reference.state_dict()
    params = max((named[n] - t).abs().max().item() for n, t in _whole(ours).items())
    return {
        "norm": max(norm_errors),
        "params": params,
        "clipped": all(clipped),
        "replicas": replica.count,
        "placement": ours.placement.lines(),  # type: ignore[union-attr]
    }


#: On inter=2 x intra=2: (key, strategy) for the data-parallel strategies.
DATA_CASES: list[tuple[str, Any]] = [("dp", "dp"), ("zero3", "zero3"), ("hsdp", "hsdp")]
#: On dp=2 x fsdp=1 x tp=2: tensor parallelism composed with a sharder.
SPLIT_CASES: list[tuple[str, Any]] = [("tp+zero3", ["tp", "zero3"]), ("tp+hsdp", ["tp", "hsdp"])]
FOUR_RANK_CASES = DATA_CASES + SPLIT_CASES
#: The data replicas each case sees (tp ranks share a batch).
REPLICAS = {"dp": 4, "zero3": 4, "hsdp": 4, "tp+zero3": 2, "tp+hsdp": 2, "tp": 1}


def _data_job() -> dict[str, Any]:
    lamina.init(mesh={"inter": 2, "intra": 2})
    out = {
        f"{key}/{name}": _clipped_run(name, strategy)
        for key, strategy in DATA_CASES
        for name in ("gpt", "llama")
    }
    lamina.shutdown()
    return out


def _split_job() -> dict[str, Any]:
    lamina.init(mesh={"dp": 2, "fsdp": 1, "tp": 2})
    out = {
        f"{key}/{name}": _clipped_run(name, strategy)
        for key, strategy in SPLIT_CASES
        for name in ("gpt", "llama")
    }
    out["tp+zero3/llama/inf"] = _clipped_run("llama", ["tp", "zero3"], norm_type=math.inf)
    lamina.shutdown()
    return out


def _tp_job() -> dict[str, Any]:
    lamina.init(mesh={"tp": 2})
    out = {f"tp/{name}": _clipped_run(name, "tp") for name in ("gpt", "llama")}
    lamina.shutdown()
    return out


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict[str, Any]]:
    """Both four-rank jobs' results, merged per rank (one lamina.init per job)."""
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    data = run_ranks(_data_job, 4, env=env, timeout=300)
    split = run_ranks(_split_job, 4, env=env, timeout=300)
    return [a | b for a, b in zip(data, split, strict=True)]


@pytest.fixture(scope="module")
def tp_results() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_tp_job, 2, env=env, timeout=300)


def _check(results: list[dict[str, Any]], key: str) -> None:
    for rank, result in enumerate(results):
        got = result[key]
        assert got["clipped"], (rank, key, "the reference norm never passed MAX_NORM")
        assert got["norm"] <= 1e-6, (rank, key, got["norm"])
        assert got["params"] <= 1e-5, (rank, key, got["params"])
        assert got["replicas"] == REPLICAS[key.split("/")[0]], (rank, key)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("key", [c[0] for c in FOUR_RANK_CASES])
def test_clipping_gives_the_one_process_norm_and_parameters(
    four_rank_results: list[dict[str, Any]], key: str, name: str
) -> None:
    _check(four_rank_results, f"{key}/{name}")


@pytest.mark.timeout(700)
def test_the_infinity_norm_of_a_split_and_sharded_model_is_the_one_process_one(
    four_rank_results: list[dict[str, Any]],
) -> None:
    _check(four_rank_results, "tp+zero3/llama/inf")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_clipping_a_tensor_parallel_model_gives_the_one_process_norm(
    tp_results: list[dict[str, Any]], name: str
) -> None:
    _check(tp_results, f"tp/{name}")


@pytest.mark.timeout(700)
def test_each_parameter_is_placed_by_every_strategy_that_holds_it(
    four_rank_results: list[dict[str, Any]],
) -> None:
    lines = four_rank_results[0]["tp+zero3/llama"]["placement"]
    assert "role tp: split over ['tp']" in lines
    assert "role zero3: shard over ['dp', 'fsdp']" in lines
    assert (
        "model.layers.0.self_attn.q_proj.weight: dp: Shard(0), fsdp: Shard(0), tp: Split(0)"
        in lines
    )
    assert (
        "model.layers.0.self_attn.o_proj.weight: dp: Shard(0), fsdp: Shard(0), tp: Split(1)"
        in lines
    )
    assert "model.norm.weight: dp: Shard(0), fsdp: Shard(0), tp: Replicate()" in lines
    hsdp = four_rank_results[0]["tp+hsdp/gpt"]["placement"]
    assert "role hsdp: replicate over ['dp']" in hsdp


# the placement model, in one process


def _mesh_placement() -> ModelPlacement:
    return ModelPlacement((("pp", 2), ("dp", 2), ("tp", 2)))


def test_a_piece_is_held_by_its_replicas_and_the_stages_sharing_it() -> None:
    placed = _mesh_placement().placed(
        Role("tp", "split", ("tp",)), {"w": {"tp": Split(0)}, "b": {"tp": Replicate()}}
    )
    placed = placed.placed(
        Role("pp", "pipeline", ("pp",)), {"w": {"pp": Stage((0,))}, "b": {"pp": Stage((0, 1))}}
    )
    placed = placed.placed(
        Role("pp", "replicate", ("dp",), data=True),
        {"w": {"dp": Replicate()}, "b": {"dp": Replicate()}},
    )
    assert placed.copies("w") == 2  # the two pipelines
    assert placed.copies("b") == 2 * 2 * 2  # pipelines, tp ranks, the two stages sharing it
    assert placed.data_axes == ("dp",)
    assert placed.replica({"pp": 1, "dp": 1, "tp": 0}) == (1, 2)
    assert placed.of("w").describe() == "pp: Stage(0), dp: Replicate(), tp: Split(0)"


def test_one_axis_takes_one_role_unless_a_sharder_spans_a_split_of_activations() -> None:
    mesh = ModelPlacement((("dp", 2), ("cp", 2)))
    zero3 = Role("zero3", "shard", ("dp",), data=True)
    replicated = mesh.placed(
        Role("dp", "replicate", ("cp",), data=True), {"w": {"cp": Replicate()}}
    )
    with pytest.raises(
        ConfigError, match=r"both take mesh axis 'cp'; give each its own axis"
    ) as err:
        replicated.placed(
            Role("zero3", "shard", ("dp", "cp")), {"w": {"dp": Shard(), "cp": Shard()}}
        )
    assert "\n" not in str(err.value)
    # a split that leaves every parameter whole (context parallelism) shares its axis
    sequence = mesh.placed(Role("cp", "split", ("cp",)), {"w": {"cp": Replicate()}})
    both = sequence.placed(
        Role("zero3", "shard", ("dp", "cp"), data=True), {"w": {"dp": Shard(), "cp": Shard()}}
    )
    assert both.of("w").describe() == "dp: Shard(0), cp: Shard(0)"
    assert both.copies("w") == 1
    cut = mesh.placed(Role("tp", "split", ("cp",)), {"w": {"cp": Split(0)}})
    with pytest.raises(ConfigError, match="both take mesh axis 'cp'"):
        cut.placed(zero3.__class__("zero3", "shard", ("cp",)), {"w": {"cp": Shard()}})


def test_an_unknown_role_or_axis_is_one_line() -> None:
    with pytest.raises(ConfigError, match="declares role 'mirror'"):
        Role("x", "mirror", ("dp",))
    with pytest.raises(ConfigError, match="places axis 'tp', which the mesh"):
        ModelPlacement((("dp", 2),)).placed(Role("tp", "split", ("tp",)), {})


def test_the_composition_order_follows_from_the_declared_roles() -> None:
    from lamina.strategies.compose import check_order
    from lamina.strategies.registry import get_strategy

    def order(*names: str) -> list[str]:
        return [s.name for s in check_order([get_strategy(n) for n in names])]

    assert order("pp", "tp", "zero3") == ["tp", "pp", "zero3"]
    assert order("tp", "hsdp") == ["tp", "hsdp"]
    assert order("pp", "zero3") == ["pp", "zero3"]
    with pytest.raises(ConfigError, match=r"'dp' cannot hold a model 'tp' has placed"):
        order("tp", "dp")
    with pytest.raises(ConfigError, match=r"\['zero3', 'hsdp'\] both shard the model"):
        order("zero3", "hsdp")


def test_an_order_of_norm_lamina_does_not_compute_is_one_line() -> None:
    from lamina.strategies.grad_norm import grad_norm

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"norm_type=-1\.0 is not a norm") as err:
        grad_norm(model, ModelPlacement((("dp", 1),)), -1.0)
    assert "\n" not in str(err.value)
