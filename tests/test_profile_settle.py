"""How ``"auto"``'s profile decides a timing has settled (:mod:`lamina.auto.measure`):
the ranks agree on every figure, the count of runs each timed included."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import lamina
from lamina.auto.measure import SETTLE_CAP_S, SETTLE_MAX_SAMPLES, _settled
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
