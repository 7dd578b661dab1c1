"""How the timings every rank takes at once become figures every rank agrees on:
``"auto"``'s profile decides together when a timing has settled
(:mod:`lamina.auto.measure`), and the pipeline's block costs are the ranks' mean, each
block's runs back to back after one barrier (:mod:`lamina.strategies.pp`)."""

from __future__ import annotations

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


def test_each_blocks_runs_follow_one_barrier_back_to_back() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    x = torch.randn(4, 8)
    chain = find_chain(model, lambda: model(x))
    barriers: list[int] = []
    calls: list[int] = []
    for name in chain.blocks:
        model.get_submodule(name).register_forward_hook(lambda *_: calls.append(len(barriers)))
    costs = measure_costs(model, chain, lambda: model(x), 4, lambda: barriers.append(1))
    # one barrier per block and one for the rest, never one per run
    assert len(barriers) == len(chain.blocks) + 1
    assert len(costs.blocks) == len(chain.blocks) and all(c > 0 for c in costs.blocks)
    assert calls.count(1) >= 5  # the first block's warm-up and 4 runs after one barrier
