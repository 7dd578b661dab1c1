"""EpochSampler: every sample of an epoch once, also across a resume on another world size."""

from __future__ import annotations

import pytest

from lamina.data import EpochSampler
from lamina.errors import ConfigError


def _run(samplers: list[EpochSampler], steps: int) -> list[int]:
    seen: list[int] = []
    for _ in range(steps):
        for sampler in samplers:
            seen += sampler.next_batch()
    return seen


@pytest.mark.parametrize(("before", "after"), [(2, 1), (2, 3), (3, 2), (4, 4)])
def test_a_resumed_job_sees_each_sample_of_the_epoch_exactly_once(before: int, after: int) -> None:
    n, batch = 103, 4
    first = [EpochSampler(n, batch, r, before, seed=7) for r in range(before)]
    seen = _run(first, 5)  # 5 global batches, then a checkpoint
    state = first[0].state_dict()
    assert all(s.state_dict() == state for s in first)  # the same on every rank
    second = [EpochSampler(n, batch, r, after, seed=7) for r in range(after)]
    for sampler in second:
        sampler.load_state_dict(state)
    while second[0].position < n:
        seen += _run(second, 1)
    assert sorted(seen) == list(range(n))
    assert second[0].next_batch() and second[0].epoch == 1  # the next epoch starts


def test_epochs_are_reshuffled_and_reproducible() -> None:
    a = EpochSampler(10, 5, 0, 1, seed=3)
    first, second = a.next_batch() + a.next_batch(), a.next_batch() + a.next_batch()
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    b = EpochSampler(10, 5, 0, 1, seed=3)
    assert b.next_batch() + b.next_batch() == first


def test_bad_arguments_and_foreign_states_are_refused() -> None:
    with pytest.raises(ConfigError, match="rank=2 is not below world_size=2"):
        EpochSampler(10, 2, 2, 2)
    with pytest.raises(ConfigError, match="batch_size=0"):
        EpochSampler(10, 0, 0, 1)
    state = EpochSampler(10, 2, 0, 1, seed=1).state_dict()
    with pytest.raises(ConfigError, match="seed=1 but this sampler 2"):
        EpochSampler(10, 2, 0, 1, seed=2).load_state_dict(state)


def test_drop_last_gives_only_full_batches_and_skips_the_short_tail() -> None:
    n, batch, world = 23, 2, 3  # 3 full global batches of 6, then 5 left over
    samplers = [EpochSampler(n, batch, r, world, seed=1, drop_last=True) for r in range(world)]
    epoch = _run(samplers, 3)
    assert len(set(epoch)) == 18
    following = [s.next_batch() for s in samplers]  # the tail is skipped: a new epoch
    assert all(len(b) == batch for b in following) and samplers[0].epoch == 1
    with pytest.raises(ConfigError, match="no full global batch"):
        EpochSampler(5, 2, 0, 3, drop_last=True)
