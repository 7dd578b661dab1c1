"""CheckpointManager puts back every stream and position a resume needs, on each rank: the
RNG streams (torch's, Python's ``random``, NumPy's, and the device's through the
DeviceHandle where the backend has one), the LR scheduler and ``EpochSampler``'s place.

Two ranks (on ``device_backend``: cpu unless ``$LAMINA_TEST_BACKEND`` names another, see
``requested_backend.py``) each set their streams to their own seeds, save, write other
values over every one of them, load, and compare what ``load_latest`` put back with
what was there at the save, and the next draws with the draws taken right after it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import lamina
from lamina.checkpoint import CheckpointManager
from lamina.data import EpochSampler
from lamina.testing import run_ranks

#: Samples and per-rank batch of the sampler: 8 global batches of 6 per epoch, then 2 left.
DATASET, BATCH = 50, 3


def _streams(runtime: lamina.Runtime) -> dict[str, Any]:
    """Every random stream's state, as plain values that compare with ``==``."""
    np_name, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "python": random.getstate(),
        "numpy": (np_name, np_keys.tolist(), np_pos, np_gauss, np_cached),
    }
    if runtime.device.type != "cpu":  # the cpu backend's device stream is torch's
        state["device"] = runtime.handle.get_rng_state(runtime.device).tolist()
    return state


def _draws(runtime: lamina.Runtime) -> dict[str, Any]:
    """The next numbers of every stream (this advances them)."""
    out: dict[str, Any] = {
        "torch": torch.rand(4).tolist(),
        "python": [random.random() for _ in range(4)],
        "numpy": np.random.rand(4).tolist(),
    }
    if runtime.device.type != "cpu":
        out["device"] = torch.rand(4, device=runtime.device).cpu().tolist()
    return out


def _seed(runtime: lamina.Runtime, seed: int) -> None:
    """Each stream from its own seed (the device's through the handle)."""
    torch.manual_seed(seed)
    random.seed(seed + 1)
    np.random.seed(seed + 2)
    if runtime.device.type != "cpu":
        runtime.handle.manual_seed(seed + 3)


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _save_overwrite_load(backend: str, directory: str) -> dict[str, Any]:
    runtime = lamina.init(backend=backend)  # by name: LAMINA_BACKEND stays cpu in tests
    rank, world = runtime.rank, runtime.world_size
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(runtime.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = _schedule(optimizer)
    sampler = EpochSampler(DATASET, BATCH, rank, world, seed=5)
    for _ in range(3):
        optimizer.step()
        scheduler.step()  # last_epoch 3, lr 0.5
    for _ in range(11):  # into the second epoch
        sampler.next_batch()
    _seed(runtime, 100 * (rank + 1))
    _draws(runtime)  # away from the seeded states
    saved = {
        "streams": _streams(runtime),
        "scheduler": scheduler.state_dict(),
        "lr": optimizer.param_groups[0]["lr"],
        "sampler": sampler.state_dict(),
    }
    manager = CheckpointManager(directory)
    manager.save(4, model, optimizer, scheduler, extra={"data": sampler.state_dict()})
    after_save = _draws(runtime)
    next_batches = [sampler.next_batch() for _ in range(4)]

    # write other values over every one of them, as a fresh process would have
    _seed(runtime, 7)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    sampler = EpochSampler(DATASET, BATCH, rank, world, seed=5)
    overwritten = {
        "streams": _streams(runtime),
        "scheduler": scheduler.state_dict(),
        "lr": optimizer.param_groups[0]["lr"],
        "sampler": sampler.state_dict(),
    }

    fresh = CheckpointManager(directory)
    step = fresh.load_latest(model, optimizer, scheduler)
    if fresh.extra is not None:
        sampler.load_state_dict(fresh.extra["data"])
    restored = {
        "streams": _streams(runtime),
        "scheduler": scheduler.state_dict(),
        "lr": optimizer.param_groups[0]["lr"],
        "sampler": sampler.state_dict(),
    }
    return {
        "step": step,
        "resumed_from": fresh.resumed_from,
        "device": runtime.device.type,
        "declared": runtime.backend.device_type,
        "saved": saved,
        "overwritten": overwritten,
        "restored": restored,
        "after_save": after_save,
        "after_load": _draws(runtime),
        "next_batches": next_batches,
        "batches_after_load": [sampler.next_batch() for _ in range(4)],
    }


@pytest.fixture(scope="module")
def ranks(device_backend: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("restore") / "ckpt"
    return run_ranks(_save_overwrite_load, 2, args=(device_backend, str(directory)), timeout=180)


@pytest.mark.timeout(240)
def test_the_job_ran_where_asked_and_resumed_the_saved_step(
    ranks: list[dict[str, Any]], device_backend: str
) -> None:
    for result in ranks:
        assert result["step"] == 4
        assert isinstance(result["resumed_from"], Path) and result["resumed_from"].name == "step-4"
        assert result["device"] == result["declared"], device_backend


@pytest.mark.timeout(240)
@pytest.mark.parametrize("what", ["scheduler", "lr", "sampler"])
def test_the_scheduler_and_the_data_position_are_put_back(
    ranks: list[dict[str, Any]], what: str
) -> None:
    for rank, result in enumerate(ranks):
        assert result["overwritten"][what] != result["saved"][what], (rank, what)  # changed
        assert result["restored"][what] == result["saved"][what], (rank, what)


@pytest.mark.timeout(240)
def test_every_random_stream_of_each_rank_is_put_back(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        saved, overwritten = result["saved"]["streams"], result["overwritten"]["streams"]
        restored = result["restored"]["streams"]
        device = {"device"} if result["device"] != "cpu" else set()
        assert set(saved) == {"torch", "python", "numpy"} | device, rank
        for name in saved:
            assert overwritten[name] != saved[name], (rank, name)  # changed
            assert restored[name] == saved[name], (rank, name)
    # each rank its own states, not rank 0's
    assert ranks[0]["saved"]["streams"] != ranks[1]["saved"]["streams"]


@pytest.mark.timeout(240)
def test_the_next_draws_and_batches_are_those_after_the_save(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(ranks):
        assert result["after_load"] == result["after_save"], rank
        assert result["batches_after_load"] == result["next_batches"], rank
    assert ranks[0]["next_batches"] != ranks[1]["next_batches"]  # each rank its own slice
