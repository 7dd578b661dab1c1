"""ZeRO-3 against torch DDP on real ranks: the same gradients every step, the same parameters
after the steps, with both primitive families (native all_gather / reduce_scatter and
their all-reduce forms), and sharded state.

Every rank builds its model from its own seed, so only the wrap-time broadcasts (lamina's
and DDP's) make the ranks start from rank 0's weights. After every backward each unit's
shard gradient is compared with this rank's slice of DDP's gradients laid out as the
unit's flat buffer, so a wrongly scaled mean fails even where AdamW would hide it. One
module-scoped 2-rank job runs every configuration; each test asserts on its part.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.testing import run_ranks
from models_for_tests import (
    batch,
    build,
    differs_from_rank0,
    full_params,
    loss_of,
    shard_grad_diff,
)

pytestmark = [pytest.mark.portable, pytest.mark.cross_release]

NAMES = ("mlp", "gpt", "tied", "unused")
COLLECTIVES = ("native", "all_reduce")
#: fp32 ZeRO-3 and DDP differ only in rounding order (the mean of two ranks' shares, taken
#: by a reduce-scatter or an all-reduce vs DDP's bucket all-reduce): a few float32 ulps
#: (2**-23 ~ 1.2e-7) per step, compounded by AdamW over the steps; a wrong mean is >= 0.5.
GRAD_TOLERANCE = 1e-6
PARAM_TOLERANCE = 1e-5


def _param_diff(ours: nn.Module, ddp: DDP) -> float:
    gathered = full_params(ours)
    return max((gathered[n] - p).abs().max().item() for n, p in ddp.module.named_parameters())


def _compare_with_ddp(
    name: str, steps: int = 5, collectives: str = "auto", **options: Any
) -> dict[str, Any]:
    """``steps`` AdamW steps of ZeRO-3 and DDP from rank-dependent initial weights."""
    runtime = lamina.init()
    rank = runtime.rank
    initial = build(name, seed=rank)
    ours = lamina.distribute(copy.deepcopy(initial), "zero3", collectives=collectives, **options)
    ddp = DDP(copy.deepcopy(initial), find_unused_parameters=(name == "unused"))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    grad_diffs = []
    for step in range(steps):
        x, y = batch(name, step, rank)
        for model in (ours, ddp):
            loss_of(name, model(x), y).backward()
        grad_diffs.append(shard_grad_diff(ours, ddp.module, rank))
        for opt in (opt_ours, opt_ddp):
            opt.step()
            opt.zero_grad(set_to_none=True)
    gathered = full_params(ours)
    reference_params = dict(ddp.module.named_parameters())
    engine = ours.lamina_engine  # type: ignore[union-attr]
    total = sum(p.numel() for p in ddp.module.parameters())
    local = sum(p.to_local().numel() for p in ours.parameters())  # type: ignore[operator]
    report = ours.memory_report(opt_ours)  # type: ignore[operator]
    return {
        "started_apart": differs_from_rank0(name, initial),
        "grad_diffs": grad_diffs,
        "diff": _param_diff(ours, ddp),
        "names": sorted(gathered) == sorted(reference_params),
        "primitives": sorted({(u.primitive, u.scatter_primitive) for u in engine.units}),
        "local_fraction": local / total,
        "state_bytes": report["optimizer_state"],
        "world": runtime.world_size,
        "gathers": {u.layout.name: u.gathers for u in engine.units},
        "held": [u.layout.name for u in engine.units if u.full is not None],
        "steps": steps,
    }


def _odd_sized(rank: int) -> dict[str, Any]:
    initial = build("odd", seed=rank)
    ours = lamina.distribute(copy.deepcopy(initial), "zero3")
    ddp = DDP(copy.deepcopy(initial))
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grad_diffs = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 3, generator=gen)
        for model in (ours, ddp):
            torch.nn.functional.mse_loss(model(x), y).backward()
        grad_diffs.append(shard_grad_diff(ours, ddp.module, rank))
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    return {"grad_diffs": grad_diffs, "diff": _param_diff(ours, ddp)}


def _clip_matches_unsharded(rank: int) -> tuple[float, float]:
    initial = build("mlp", seed=rank)
    ours = lamina.distribute(copy.deepcopy(initial), "zero3")
    ddp = DDP(copy.deepcopy(initial))
    x, y = batch("mlp", 0, rank)
    for model in (ours, ddp):
        loss_of("mlp", model(x), y).backward()
    ours_norm = ours.clip_grad_norm_(1e-3).item()  # type: ignore[operator]
    ddp_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3).item()
    return ours_norm, ddp_norm


def _mixed_precision(rank: int) -> dict[str, object]:
    initial = build("gpt", seed=rank)
    ours = lamina.distribute(
        copy.deepcopy(initial), "zero3", min_unit_numel=0, param_dtype=torch.bfloat16
    )
    ddp = DDP(copy.deepcopy(initial))
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1)
    dtypes = set()
    grad_norm_diffs = []
    for step in range(3):
        x, y = batch("gpt", step, rank)
        out = ours(x)
        dtypes.add(out.dtype)
        loss_of("gpt", out.float(), y).backward()
        loss_of("gpt", ddp(x), y).backward()
        grad_dtypes = {p.grad.dtype for p in ours.parameters() if p.grad is not None}
        # relative difference of the whole gradient (norms, not elements: bf16 compute
        # leaves single tiny elements with large relative errors)
        reference = dict(ddp.module.named_parameters())
        shards = torch.cat(
            [p.grad.full_tensor().flatten() for _, p in ours.named_parameters()]  # type: ignore[union-attr]
        )
        expected = torch.cat(
            [reference[n].grad.flatten() for n, _ in ours.named_parameters()]  # type: ignore[union-attr]
        )
        grad_norm_diffs.append(((shards - expected).norm() / expected.norm()).item())
        for opt in (opt_ours, opt_ddp):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {
        "diff": _param_diff(ours, ddp),
        "grad_norm_diffs": grad_norm_diffs,
        "out": dtypes,
        "grads": grad_dtypes,
        "shards": {p.dtype for p in ours.parameters()},
    }


def _zero3_job() -> dict[str, Any]:
    """Every 2-rank configuration of this module on this rank."""
    rank = lamina.init().rank
    return {
        "ddp": {
            (name, collectives): _compare_with_ddp(name, collectives=collectives)
            for name in NAMES
            for collectives in COLLECTIVES
        },
        "odd": _odd_sized(rank),
        "clip": _clip_matches_unsharded(rank),
        "blocks": {
            reshard: _compare_with_ddp(
                "gpt", steps=3, min_unit_numel=0, reshard_after_forward=reshard
            )
            for reshard in (True, False)
        },
        "mixed": _mixed_precision(rank),
    }


@pytest.fixture(scope="module")
def zero3_results() -> list[dict[str, Any]]:
    return run_ranks(_zero3_job, 2, timeout=200)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("collectives", COLLECTIVES)
@pytest.mark.parametrize("name", NAMES)
def test_zero3_matches_ddp_after_five_steps(
    name: str, collectives: str, zero3_results: list[dict[str, Any]]
) -> None:
    results = [r["ddp"][name, collectives] for r in zero3_results]
    assert results[1]["started_apart"], results[1]  # rank 1 built other weights than rank 0
    primitive = "native" if collectives == "native" else "all_reduce"
    for result in results:
        assert result["primitives"] == [(primitive, primitive)], result  # what was compared
        assert max(result["grad_diffs"]) <= GRAD_TOLERANCE, result  # every step
        assert result["diff"] <= PARAM_TOLERANCE, result
        assert result["names"], result
        # half of the parameters, plus alignment padding (large for the tiniest models)
        assert result["local_fraction"] <= (0.6 if name in ("mlp", "gpt") else 0.9), result


def test_zero3_world_size_one_trains() -> None:
    result = _compare_with_ddp("mlp", steps=3)
    assert result["world"] == 1 and max(result["grad_diffs"]) <= GRAD_TOLERANCE, result
    assert result["diff"] <= PARAM_TOLERANCE, result


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_odd_sized_model_needing_padding_matches_ddp(
    zero3_results: list[dict[str, Any]],
) -> None:
    for result in (r["odd"] for r in zero3_results):
        assert max(result["grad_diffs"]) <= GRAD_TOLERANCE, result  # padding included
        assert result["diff"] <= PARAM_TOLERANCE, result


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_clip_grad_norm_uses_the_global_norm(zero3_results: list[dict[str, Any]]) -> None:
    for ours, ddp in (r["clip"] for r in zero3_results):
        assert abs(ours - ddp) <= 1e-5 * max(1.0, ddp)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("reshard", [True, False])
def test_block_units_are_freed_after_forward_and_gathered_again_in_backward(
    reshard: bool, zero3_results: list[dict[str, Any]]
) -> None:
    for result in (r["blocks"][reshard] for r in zero3_results):
        assert max(result["grad_diffs"]) <= GRAD_TOLERANCE, result
        assert result["diff"] <= PARAM_TOLERANCE, result
        gathers = result["gathers"]
        assert isinstance(gathers, dict) and {"blocks.0", "blocks.1", "(root)"} <= set(gathers)
        # forward, and again in backward when resharded; the last block (backward starts
        # with it) and the root (gathered for the whole forward, needed until backward
        # ends) stay gathered from their forward to their backward
        steps = result["steps"]
        assert gathers["blocks.0"] == (2 if reshard else 1) * steps, result
        assert gathers["blocks.1"] == gathers["(root)"] == steps, result
        assert result["held"] == [], result  # no full parameters between steps


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_mixed_precision_computes_in_bf16_and_reduces_in_fp32(
    zero3_results: list[dict[str, Any]],
) -> None:
    for result in (r["mixed"] for r in zero3_results):
        assert result["out"] == {torch.bfloat16}, result
        assert result["grads"] == {torch.float32} and result["shards"] == {torch.float32}
        # bf16 compute (8-bit mantissa) tracks the fp32 gradients within a few percent of
        # their norm; a wrong mean would be off by 50% or more
        assert max(result["grad_norm_diffs"]) <= 0.05, result
        assert result["diff"] <= 5e-3, result  # bf16 compute tracks the fp32 run
