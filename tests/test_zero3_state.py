"""ZeRO-3 state dicts (full and DCP-sharded) and memory accounting on 2 real ranks.

One module-scoped 2-rank job runs both parts (spawning ranks is the slow part); each test
asserts on its own. The full state dict is compared with torch DDP's after training from
rank-dependent initial weights, so it matches only through the wrap-time broadcasts.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.errors import ConfigError
from lamina.memory import build_layout
from lamina.testing import run_ranks
from models_for_tests import batch, build, differs_from_rank0, loss_of

pytestmark = pytest.mark.portable


def _train(model: Any, opt: torch.optim.Optimizer, name: str, steps: int, rank: int) -> None:
    for step in range(steps):
        x, y = batch(name, step, rank)
        loss_of(name, model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _shards(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.shards]


def _state_round_trips(checkpoint_dir: str) -> dict[str, Any]:
    runtime = lamina.init()
    initial = build("gpt", seed=runtime.rank)  # ranks start apart: the broadcasts align them
    ours: Any = lamina.distribute(copy.deepcopy(initial), "zero3")
    ddp = DDP(copy.deepcopy(initial))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    _train(ours, opt_ours, "gpt", 2, runtime.rank)
    _train(ddp, opt_ddp, "gpt", 2, runtime.rank)
    result: dict[str, Any] = {"started_apart": differs_from_rank0("gpt", initial)}

    # full state dict on rank 0 against DDP's module state dict
    full = ours.full_state_dict()
    expected = ddp.module.state_dict()
    if runtime.rank == 0:
        result["full_keys"] = sorted(full) == sorted(expected)
        result["full_shapes"] = all(full[k].shape == v.shape for k, v in expected.items())
        result["full_diff"] = max((full[k] - v).abs().max().item() for k, v in expected.items())
        result["full_cpu"] = all(t.device.type == "cpu" for t in full.values())
    else:
        result["full_empty"] = full == {}

    # sharded round trip through torch.distributed.checkpoint into a fresh model
    dcp.save(ours.sharded_state_dict(), checkpoint_id=checkpoint_dir)
    fresh: Any = lamina.distribute(_perturbed("gpt"), "zero3")
    before = [torch.equal(a, b) for a, b in zip(_shards(fresh), _shards(ours), strict=True)]
    loaded = fresh.sharded_state_dict()
    dcp.load(loaded, checkpoint_id=checkpoint_dir)
    fresh.load_sharded_state_dict(loaded)
    result["sharded_differed_before"] = not all(before)
    result["sharded_exact"] = all(
        torch.equal(a, b) for a, b in zip(_shards(fresh), _shards(ours), strict=True)
    )

    # full round trip: every rank takes its slice of the full dict
    everywhere = ours.full_state_dict(rank0_only=False)
    other: Any = lamina.distribute(_perturbed("gpt"), "zero3")
    other.load_full_state_dict(everywhere)
    result["full_exact"] = all(
        torch.equal(a, b) for a, b in zip(_shards(other), _shards(ours), strict=True)
    )

    # a layout that is not the model's: one-line error naming both fingerprints
    wrong = ours.sharded_state_dict()
    wrong["layout"] = build_layout(build("gpt"), runtime.world_size, alignment_bytes=64).to_json()
    try:
        ours.load_sharded_state_dict(wrong)
        result["mismatch"] = None
    except ConfigError as exc:
        result["mismatch"] = str(exc)
    result["fingerprint"] = ours.layout.fingerprint()[:16]
    return result


def _perturbed(name: str) -> torch.nn.Module:
    model = build(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def _state_job(checkpoint_dir: str) -> dict[str, dict[str, Any]]:
    """Both 2-rank parts of this module on this rank."""
    return {"state": _state_round_trips(checkpoint_dir), "account": _account()}


@pytest.fixture(scope="module")
def state_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    checkpoint = str(tmp_path_factory.mktemp("zero3_state") / "ckpt")
    return run_ranks(_state_job, 2, args=(checkpoint,), timeout=150)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_full_and_sharded_state_dicts_round_trip(
    state_results: list[dict[str, dict[str, Any]]],
) -> None:
    results = [r["state"] for r in state_results]
    rank0, rank1 = results
    assert rank0["full_keys"] and rank0["full_shapes"] and rank0["full_cpu"], rank0
    assert rank0["full_diff"] <= 1e-5, rank0
    assert rank1["full_empty"], rank1
    assert rank1["started_apart"], rank1  # rank 1 built other weights than rank 0
    for result in results:
        assert result["sharded_differed_before"] and result["sharded_exact"], result
        assert result["full_exact"], result
        message = result["mismatch"]
        assert isinstance(message, str) and "\n" not in message, result
        assert result["fingerprint"] in message and "resharding" in message, result


def _account() -> dict[str, Any]:
    runtime = lamina.init()
    ours: Any = lamina.distribute(build("gpt"), "zero3")
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    x, y = batch("gpt", 0, runtime.rank)
    loss_of("gpt", ours(x), y).backward()
    opt.step()
    account = ours.memory_accounting(opt)
    return {
        "k": account.optimizer_bytes_per_param,
        "p": account.param_element_size,
        "ratio": account.ratio,
        "padding": account.padding_fraction,
        "psi": account.param_count,
        "expected_psi": sum(p.numel() for p in build("gpt").parameters()),
        "world": account.world_size,
        "table": account.table(),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_memory_accounting_matches_the_zero3_formula(
    state_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in (r["account"] for r in state_results):
        assert result["k"] == 8.0 and result["p"] == 4.0 and result["world"] == 2, result
        assert result["psi"] == result["expected_psi"], result
        assert 1.0 <= result["ratio"] <= 1.0 + result["padding"] + 1e-3, result
        assert "(P+G+K)Psi/N" in result["table"] and "(4+4+8)" in result["table"], result
