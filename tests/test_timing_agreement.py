"""How the timings every rank takes at once become figures every rank agrees on:
``"auto"``'s profile decides together when a timing has settled
(:mod:`lamina.auto.measure`), and the pipeline's block costs are the ranks' mean, each
block's runs back to back, as many on every rank (:mod:`lamina.strategies.pp`)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lamina
from lamina.auto.measure import SETTLE_CAP_S, SETTLE_MAX_SAMPLES, _settled
from lamina.strategies.pp import _agreed
from lamina.strategies.pp.chain import find_chain
from lamina.strategies.pp.cut import BlockCosts, measure_costs
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


def _mean_job() -> tuple[tuple[float, ...], float]:
    runtime = lamina.init()
    try:
        # a rank sharing its cores times slower: the step waits for it, so it counts
        mine = BlockCosts((1.0, 2.0), 0.5) if runtime.rank == 0 else BlockCosts((3.0, 4.0), 1.5)
        agreed = _agreed(mine, runtime.device)
        return agreed.blocks, agreed.rest
    finally:
        lamina.shutdown()


@pytest.mark.multiprocess
def test_the_pipelines_block_costs_are_the_ranks_mean_on_every_rank() -> None:
    assert run_ranks(_mean_job, 2, timeout=120) == [((2.0, 3.0), 1.0)] * 2


def test_each_blocks_runs_follow_one_agreed_count_back_to_back() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    x = torch.randn(4, 8)
    chain = find_chain(model, lambda: model(x))
    asked: list[int] = []
    calls: list[int] = []
    for name in chain.blocks:
        model.get_submodule(name).register_forward_hook(lambda *_: calls.append(len(asked)))

    def agreed_runs(count: int) -> int:
        asked.append(count)
        return 7  # another rank needed more: every rank runs the largest count

    costs = measure_costs(model, chain, lambda: model(x), 4, agreed_runs)
    # one agreement per block and one for the rest, never one per run
    assert len(asked) == len(chain.blocks) + 1
    assert all(count >= 4 for count in asked)
    assert len(costs.blocks) == len(chain.blocks) and all(c > 0 for c in costs.blocks)
    # the first block's 7 runs after its one agreement, then the second's warm-up (which
    # times how many runs it asks for)
    assert calls.count(1) == 7 + 1


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


def test_a_blocks_cost_is_its_runs_mean_not_their_median() -> None:
    model = nn.Sequential(_SometimesStopped(), _SometimesStopped())
    x = torch.randn(2, 8)
    chain = find_chain(model, lambda: model(x))
    costs = measure_costs(model, chain, lambda: model(x), 5)
    # the median would be ~1 ms; the step pays the stopped runs too: ~4 ms a run
    assert all(c > 0.0025 for c in costs.blocks), costs.blocks
    assert model[0].calls >= 1 + 5  # warm-up, then at least the runs asked for
