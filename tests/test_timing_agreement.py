"""How the timings every rank takes at once become figures every rank agrees on:
``"auto"``'s profile starts each run together, counts the slowest rank's time and decides
together when a timing has settled (:mod:`lamina.auto.measure`), and the pipeline's block
costs are the slowest rank's, each block's runs back to back, as many on every rank
(:mod:`lamina.strategies.pp.cut`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lamina
from lamina.auto.measure import (
    DISPATCH_NUMEL,
    DISPATCH_TIMED_TENSORS,
    SETTLE_CAP_S,
    SETTLE_MAX_SAMPLES,
    _dispatch_seconds,
    _settled,
    profile_model,
)
from lamina.strategies.pp.chain import find_chain
from lamina.strategies.pp.cut import RanksTogether, measure_costs
from lamina.testing import run_ranks


def _settle_job() -> list[bool]:
    runtime = lamina.init()
    try:
        # rank 0 timed up to the cap, rank 1 far fewer, both spread too widely to settle
        # on width or time alone: the count alone decides, and must for both
        count = SETTLE_MAX_SAMPLES if runtime.rank == 0 else 3
        spread = [0.01 * (1 + i % 2) for i in range(count)]
        agreed = _settled(spread, 0.0, None, True)
        # neither rank near the cap: both go on
        unsettled = _settled([0.01, 0.02, 0.01], SETTLE_CAP_S / 10, None, True)
        dist.barrier()
        return [agreed, unsettled]
    finally:
        lamina.shutdown()


@pytest.mark.multiprocess
def test_every_rank_stops_timing_when_any_rank_reached_the_run_cap() -> None:
    results = run_ranks(_settle_job, 2, timeout=120)
    # a count left unagreed has rank 0 stop and rank 1 wait on a collective forever
    assert results == [[True, False], [True, False]]


def _slowest_job() -> tuple[int, float]:
    runtime = lamina.init()
    try:
        # a rank sharing its cores times slower: the step waits for it, so its time counts
        together = RanksTogether(runtime.device)
        count = together.largest(4 if runtime.rank == 0 else 7)
        seconds = together.slowest(1.0 if runtime.rank == 0 else 3.0)
        return count, seconds
    finally:
        lamina.shutdown()


@pytest.mark.multiprocess
def test_the_pipelines_block_timings_take_the_largest_count_and_slowest_time_on_every_rank() -> (
    None
):
    assert run_ranks(_slowest_job, 2, timeout=120) == [(7, 3.0)] * 2


class _Recorded:
    """Timing together as another rank would answer: it needed 7 runs, took 3x as long."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.timed: list[float] = []

    def largest(self, count: int) -> int:
        self.asked.append(count)
        return 7

    def slowest(self, seconds: float) -> float:
        self.timed.append(seconds)
        return 3 * seconds


def test_each_blocks_runs_follow_one_agreed_count_and_cost_the_slowest_ranks_time() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    x = torch.randn(4, 8)
    chain = find_chain(model, lambda: model(x))
    together = _Recorded()
    calls: list[int] = []
    for name in chain.blocks:
        model.get_submodule(name).register_forward_hook(
            lambda *_: calls.append(len(together.asked))
        )
    costs = measure_costs(model, chain, lambda: model(x), 4, together)
    # one agreement per block and one for the rest, never one per run
    assert len(together.asked) == len(chain.blocks) + 1 == len(together.timed)
    assert all(count >= 4 for count in together.asked)
    # the first block's 7 runs after its one agreement, then the second's warm-up (which
    # times how many runs it asks for)
    assert calls.count(1) == 7 + 1
    # each block costs the slowest rank's time over the agreed count (alike blocks: their
    # median)
    mine = sorted(t * 3 / 7 for t in together.timed[:-1])
    assert costs.blocks == (mine[1],) * 3
    assert costs.rest == together.timed[-1] * 3 / 7


class _SometimesStopped(nn.Module):
    """A block that usually takes 1 ms and every third run 10 ms, as a run the
    scheduler stopped for a slice does where ranks share cores."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(0.010 if self.calls % 3 == 0 else 0.001)
        return self.linear(x)


def test_a_blocks_cost_is_its_runs_whole_time_not_their_median() -> None:
    model = nn.Sequential(_SometimesStopped(), _SometimesStopped())
    x = torch.randn(2, 8)
    chain = find_chain(model, lambda: model(x))
    costs = measure_costs(model, chain, lambda: model(x), 5)
    # the median would be ~1 ms; the step pays the stopped runs too: ~4 ms a run
    assert all(c > 0.0025 for c in costs.blocks), costs.blocks
    assert model[0].calls >= 1 + 5  # warm-up, then at least the runs asked for


class _Sleeps(nn.Module):
    """A model whose forward takes ``seconds`` (the rank's share of a shared device)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def _profile_job() -> float:
    runtime = lamina.init()
    try:
        # rank 1 gets a smaller share: every run of a step waits for it
        model = _Sleeps(0.002 if runtime.rank == 0 else 0.020)
        profile = profile_model(model, (torch.randn(4, 8),), runs=3, device=runtime.device)
        return profile.forward_s
    finally:
        lamina.shutdown()


@pytest.mark.multiprocess
def test_the_profiles_runs_count_the_slowest_ranks_time_on_every_rank() -> None:
    forwards = run_ranks(_profile_job, 2, timeout=120)
    # the ranks' mean would be ~11 ms
    assert forwards[0] == forwards[1] and forwards[0] >= 0.019, forwards


def test_the_dtensor_dispatch_is_timed_per_tensor_on_tiny_tensors(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        seen: list[int] = []

        def timed(step: Callable[[], None]) -> float:
            group = step.__self__.param_groups[0]["params"]  # type: ignore[attr-defined]
            seen.extend(p.numel() for p in group)
            return 3.0 if isinstance(group[0], DTensor) else 1.0

        params = [torch.zeros(512, 512) for _ in range(10)]
        # (3 - 1) s over 16 tiny tensors, for each of the 10 parameters
        assert _dispatch_seconds(params, timed, mesh) == pytest.approx(2.0 / 16 * 10)
        assert set(seen) == {DISPATCH_NUMEL} and len(seen) == 2 * DISPATCH_TIMED_TENSORS
    finally:
        dist.destroy_process_group()
