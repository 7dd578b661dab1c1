"""ZeRO-3 state through torch's own APIs, as with FSDP2: ``model.state_dict()``,
``torch.distributed.checkpoint.state_dict`` (get/set, full and sharded) and DCP checkpoints
resharded onto other world sizes; and memory accounting against the ZeRO-3 formula.

A module-scoped 2-rank job trains, compares with torch DDP and saves DCP checkpoints; a
1-rank and a 3-rank job load them (each world size is its own job: ranks are processes).
Training starts from rank-dependent weights, so the comparisons with DDP hold only through
the wrap-time broadcasts. Each test asserts on its own part of the jobs' results.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.testing import run_ranks
from models_for_tests import batch, build, differs_from_rank0, loss_of

pytestmark = [pytest.mark.portable, pytest.mark.cross_release]

#: fp32 ZeRO-3 and DDP differ only in the rounding order of the two ranks' mean gradient (a
#: few float32 ulps, 2**-23 ~ 1.2e-7, per step), compounded by AdamW over the steps; a
#: wrong mean or a missing broadcast is off by 1e-3 or more. (Measured: 0.0 on cpu/gloo.)
DDP_TOLERANCE = 1e-5
#: The optimizer's moments: exp_avg_sq holds squared gradients (~1e-4 here), so its
#: rounding differences are far below this; a gradient off by a factor 2 is not.
MOMENT_TOLERANCE = 1e-6
FULL = StateDictOptions(full_state_dict=True)
#: Full tensors on rank 0's CPU, nothing on the others: what a user writes to one file.
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
#: Models saved to DCP on 2 ranks and loaded on 1 and 3: "odd" has dim 0 of 5 and 3 (uneven
#: over 2 ranks), the GPT 64, 32, 16 and 128 (uneven over 3).
DCP_MODELS = ("odd", "gpt")
LR, WEIGHT_DECAY = 1e-2, 0.1


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, name: str, steps: range, rank: int
) -> None:
    for step in steps:
        x, y = batch(name, step, rank)
        loss_of(name, model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _full(value: torch.Tensor) -> torch.Tensor:
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().clone()


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()``, gathered whole (collective)."""
    return {k: _full(v) for k, v in model.state_dict().items()}


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state, full, on rank 0's CPU (empty on other ranks)."""
    return {
        "model": get_model_state_dict(model, options=FULL_ON_RANK0),
        "optim": get_optimizer_state_dict(model, opt, options=FULL_ON_RANK0),
    }


def _eval_output(name: str, model: nn.Module) -> torch.Tensor:
    """The model's output on one fixed input, the same on every rank: what the engine's
    gathered weights compute (not only what the parameters read back)."""
    x, _ = batch(name, 1000, 0)
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(x)
    model.train()
    return out


def _checkpoint(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The sharded state a DCP checkpoint holds."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


# -- the 2-rank job --------------------------------------------------------------------------
def _state_dicts(rank: int) -> dict[str, Any]:
    initial = build("gpt", seed=rank)  # ranks start apart: the broadcasts align them
    ours = lamina.distribute(copy.deepcopy(initial), "zero3")
    ddp = DDP(copy.deepcopy(initial))
    opt_ours, opt_ddp = _adamw(ours), _adamw(ddp)
    for model, opt in ((ours, opt_ours), (ddp, opt_ddp)):
        _train(model, opt, "gpt", range(3), rank)
    expected = ddp.module.state_dict()
    result: dict[str, Any] = {"started_apart": differs_from_rank0("gpt", initial)}

    # model.state_dict(): the unwrapped model's keys, DTensors of the original shapes
    local = ours.state_dict()
    result["keys"] = (list(local), list(expected))
    result["not_sharded"] = [
        k
        for k, v in local.items()
        if not (
            isinstance(v, DTensor) and v.placements == (Shard(0),) and v.shape == expected[k].shape
        )
    ]
    full = _full_params(ours)
    result["ddp_diff"] = max((full[k] - v).abs().max().item() for k, v in expected.items())

    # full model state dict on rank 0's CPU, loaded by a plain model with strict=True
    on_rank0 = get_model_state_dict(ours, options=FULL_ON_RANK0)
    result["rank0_keys"] = sorted(on_rank0)
    result["plain_cpu"] = all(
        type(v) is torch.Tensor and v.device.type == "cpu" for v in on_rank0.values()
    )
    x, _ = batch("gpt", 99, rank)
    ours.eval()
    with torch.no_grad():
        sharded_out = ours(x)
    ours.train()
    if rank == 0:
        plain = build("gpt", seed=123).eval()
        plain.load_state_dict(on_rank0, strict=True)
        with torch.no_grad():
            result["plain_out_diff"] = (plain(x) - sharded_out).abs().max().item()

    # optimizer state by parameter name, and its moments against DDP's
    optim_full = get_optimizer_state_dict(ours, opt_ours, options=FULL)
    result["optim_names"] = sorted(optim_full["state"])
    result["optim_entries"] = {k: sorted(v) for k, v in optim_full["state"].items()}
    result["group_names"] = [sorted(g["params"]) for g in optim_full["param_groups"]]
    ddp_names = {id(p): n for n, p in ddp.module.named_parameters()}
    ddp_state = {ddp_names[id(p)]: s for p, s in opt_ddp.state.items()}
    result["moment_diff"] = max(
        (optim_full["state"][n][key] - s[key]).abs().max().item()
        for n, s in ddp_state.items()
        for key in ("exp_avg", "exp_avg_sq")
    )
    result["steps"] = sorted({float(s["step"]) for s in optim_full["state"].values()})
    sharded_optim = get_optimizer_state_dict(ours, opt_ours)
    result["optim_sharded"] = all(
        isinstance(s["exp_avg"], DTensor) for s in sharded_optim["state"].values()
    )

    # set_model_state_dict / set_optimizer_state_dict into a freshly sharded model: the
    # model from rank 0's full dict (broadcast), the optimizer from a full dict everywhere
    fresh = lamina.distribute(build("gpt", seed=50 + rank), "zero3")
    opt_fresh = torch.optim.AdamW(fresh.parameters(), lr=1.0, weight_decay=0.0)  # overwritten
    result["fresh_differed"] = any(
        not torch.equal(a, full[k]) for k, a in _full_params(fresh).items()
    )
    set_model_state_dict(
        fresh,
        on_rank0,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    # a copy, as if read from a file: loading shares the dict's plain tensors ("step"),
    # which both optimizers would then count up
    set_optimizer_state_dict(fresh, opt_fresh, copy.deepcopy(optim_full), options=FULL)
    result["loaded_exact"] = all(torch.equal(a, full[k]) for k, a in _full_params(fresh).items())
    result["loaded_lr"] = [g["lr"] for g in opt_fresh.param_groups]
    for model, opt in ((ours, opt_ours), (fresh, opt_fresh)):
        _train(model, opt, "gpt", range(3, 5), rank)
    after, after_fresh = _full_params(ours), _full_params(fresh)
    result["continued_diff"] = max(
        (after_fresh[k] - v).abs().max().item() for k, v in after.items()
    )
    result["continued_moved"] = max((after[k] - v).abs().max().item() for k, v in full.items())
    return result


def _save_checkpoints(rank: int, folder: str) -> dict[str, Any]:
    """Train each DCP model 3 steps, save it to ``folder/<name>``; its full state (rank 0)."""
    saved = {}
    for name in DCP_MODELS:
        model = lamina.distribute(build(name, seed=rank), "zero3")
        opt = _adamw(model)
        _train(model, opt, name, range(3), rank)
        dcp.save(_checkpoint(model, opt), checkpoint_id=str(Path(folder) / name))
        saved[name] = {**_full_state(model, opt), "out": _eval_output(name, model)}
    return saved


def _account(rank: int) -> dict[str, Any]:
    ours = lamina.distribute(build("gpt"), "zero3")
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    x, y = batch("gpt", 0, rank)
    loss_of("gpt", ours(x), y).backward()
    opt.step()
    account = ours.memory_accounting(opt)  # type: ignore[operator]
    local = sum(p.to_local().numel() for p in ours.parameters())  # type: ignore[operator]
    return {
        "k": account.optimizer_bytes_per_param,
        "p": account.param_element_size,
        "ratio": account.ratio,
        "padding": account.padding_fraction,
        "psi": account.param_count,
        "expected_psi": sum(p.numel() for p in build("gpt").parameters()),
        "world": account.world_size,
        "table": account.table(),
        "report": ours.memory_report(opt),  # type: ignore[operator]
        "local_numel": local,
    }


def _state_job(folder: str) -> dict[str, Any]:
    """Every 2-rank part of this module on this rank."""
    rank = lamina.init().rank
    return {
        "state": _state_dicts(rank),
        "saved": _save_checkpoints(rank, folder),
        "account": _account(rank),
    }


# -- the load jobs (1 and 3 ranks) -----------------------------------------------------------
def _load_job(folder: str) -> dict[str, Any]:
    """Load each saved checkpoint into a freshly sharded model of this world size."""
    rank = lamina.init().rank
    loaded = {}
    for name in DCP_MODELS:
        model = lamina.distribute(build(name, seed=100 + rank), "zero3")
        opt = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.0)  # overwritten
        # cloned: on one rank the full tensors are the parameters themselves
        before = {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}
        state = _checkpoint(model, opt)
        dcp.load(state, checkpoint_id=str(Path(folder) / name))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        loaded[name] = {
            **_full_state(model, opt),
            "before": before,
            "out": _eval_output(name, model),
        }
    return loaded


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("zero3_dcp"))


@pytest.fixture(scope="module")
def state_results(checkpoint_folder: str) -> list[dict[str, Any]]:
    return run_ranks(_state_job, 2, args=(checkpoint_folder,), timeout=150)


@pytest.fixture(scope="module")
def loaded_on(
    state_results: list[dict[str, Any]], checkpoint_folder: str
) -> dict[int, dict[str, Any]]:
    """Rank 0's result of loading the 2-rank checkpoints on 1 and on 3 ranks."""
    return {
        world: run_ranks(_load_job, world, args=(checkpoint_folder,), timeout=150)[0]
        for world in (1, 3)
    }


# -- tests -----------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_state_dict_has_the_models_keys_as_dtensors_equal_to_ddp(
    state_results: list[dict[str, Any]],
) -> None:
    states = [r["state"] for r in state_results]
    assert states[1]["started_apart"], states[1]  # rank 1 built other weights than rank 0
    for state in states:
        keys, expected = state["keys"]
        assert keys == expected, state  # the same keys, in the same order (tied head too)
        assert state["not_sharded"] == [], state
        assert state["ddp_diff"] <= DDP_TOLERANCE, state


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_full_model_state_dict_on_rank0_loads_into_a_plain_model(
    state_results: list[dict[str, Any]],
) -> None:
    rank0, rank1 = (r["state"] for r in state_results)
    assert rank0["rank0_keys"] == sorted(rank0["keys"][1]) and rank0["plain_cpu"], rank0
    assert rank1["rank0_keys"] == [], rank1  # cpu_offload: only rank 0 holds it
    # the same weights and the same ops: the outputs agree to rounding (float32 ulps)
    assert rank0["plain_out_diff"] <= 1e-6, rank0


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_optimizer_state_dict_is_keyed_by_parameter_name(
    state_results: list[dict[str, Any]],
) -> None:
    trainable = sorted(n for n, _ in build("gpt").named_parameters())  # tied head once
    for state in (r["state"] for r in state_results):
        assert state["optim_names"] == trainable and "blocks.0.attn.qkv.weight" in trainable
        assert set(map(tuple, state["optim_entries"].values())) == {
            ("exp_avg", "exp_avg_sq", "step")
        }, state
        assert state["group_names"] == [trainable], state
        assert state["steps"] == [3.0], state
        assert state["moment_diff"] <= MOMENT_TOLERANCE, state
        assert state["optim_sharded"], state


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_set_state_dicts_into_a_fresh_model_continue_training_identically(
    state_results: list[dict[str, Any]],
) -> None:
    for state in (r["state"] for r in state_results):
        assert state["fresh_differed"] and state["loaded_exact"], state
        assert state["loaded_lr"] == [LR], state  # the param groups came with the state
        # two more steps, both models: the same inputs, weights and moments, so the same
        # arithmetic on every rank, bit for bit; the steps did move the weights
        assert state["continued_diff"] == 0.0 and state["continued_moved"] > 1e-4, state


def _same(a: Any, b: Any) -> bool:
    """Nested dicts/lists of tensors and numbers, equal exactly."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.float(), b.float())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("name", DCP_MODELS)
def test_dcp_checkpoint_of_2_ranks_loads_on_another_world_size(
    name: str,
    world: int,
    state_results: list[dict[str, Any]],
    loaded_on: dict[int, dict[str, Any]],
) -> None:
    saved = state_results[0]["saved"][name]
    loaded = loaded_on[world][name]
    assert saved["model"] and saved["optim"]["state"], saved  # rank 0 holds the full state
    assert not _same(loaded["before"], saved["model"])  # the load had work to do
    assert _same(loaded["model"], saved["model"]), (loaded["model"], saved["model"])
    for param, entries in saved["optim"]["state"].items():
        assert sorted(entries) == ["exp_avg", "exp_avg_sq", "step"], entries
        assert _same(loaded["optim"]["state"][param], entries), param
    assert _same(loaded["optim"], saved["optim"])  # and the param groups (lr, decay)
    # the same full weights and ops on another world size: equal outputs up to float32
    # rounding (the gathered weights are the same bits; only the kernels' order may differ)
    assert (loaded["out"] - saved["out"]).abs().max().item() <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_memory_accounting_matches_the_zero3_formula(
    state_results: list[dict[str, Any]],
) -> None:
    for result in (r["account"] for r in state_results):
        assert result["k"] == 8.0 and result["p"] == 4.0 and result["world"] == 2, result
        assert result["psi"] == result["expected_psi"], result
        # the measured bytes exceed the formula by the shards' padding and no more
        assert 1.0 <= result["ratio"] <= 1.0 + result["padding"] + 1e-3, result
        assert "(P+G+K)Psi/N" in result["table"] and "(4+4+8)" in result["table"], result
        report = result["report"]
        # AdamW: two fp32 moments per element of this rank's local shards, plus the steps
        assert report["optimizer_state"] >= 8 * result["local_numel"], result
        assert report["parameters"] >= 4 * result["local_numel"], result
