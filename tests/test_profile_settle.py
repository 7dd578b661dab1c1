"""How ``"auto"``'s profile decides a timing has settled (:mod:`lamina.auto.measure`):
the ranks agree, even where one rank's window held more runs than another's."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import lamina
from lamina.auto.measure import SETTLE_CAP_S, SETTLE_MAX_SAMPLES, _settled
from lamina.testing import run_ranks


def _settle_job() -> list[bool]:
    runtime = lamina.init()
    try:
        # rank 0 ran up to the cap in its windows, rank 1 (a slower share of the cores)
        # far fewer, both spread too widely to settle on width or time alone
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
    # before the count was agreed, rank 0 stopped and rank 1 waited on its next window
    assert results == [[True, False], [True, False]]
