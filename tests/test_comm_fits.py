"""What ``"auto"`` times of the links (:mod:`lamina.auto.comm`): the fit prices a small
collective by its timed point, the overlap's all-reduces are issued as backward lands
the gradients (as data parallelism's buckets are), and timed runs interleave sizes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lamina.auto.comm import (
    FIT_SIZES,
    Fit,
    _interleaved_means,
    _issued_as_gradients_land,
    hideable,
    measure_overlap,
    overlap_share,
    weighted_median,
)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_small_collective_is_priced_by_its_timed_point_not_the_line_beyond() -> None:
    small, mid, large = FIT_SIZES
    # latency-bound below ``mid``: the line through the larger two would give ~0.6 ms
    fit = Fit.through_all([(small, 1.0e-3), (mid, 1.1e-3), (large, 5.0e-3)])
    assert fit.seconds(small) == pytest.approx(1.0e-3)
    assert fit.seconds(large) == pytest.approx(5.0e-3)
    two_point = Fit.through((mid, 1.1e-3), (large, 5.0e-3))
    assert two_point.seconds(small) < 0.9e-3


def test_the_overlap_pieces_go_out_while_backward_runs(one_rank: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    params = list(model.parameters())
    bufs = [torch.ones(8) for _ in range(4)]
    works: list[dist.Work] = []
    seen_during_backward: list[int] = []
    model[0].weight.register_post_accumulate_grad_hook(
        lambda _p: seen_during_backward.append(len(works))
    )
    with _issued_as_gradients_land(params, bufs, works):
        out = model(torch.randn(4, 32)).sum()
        assert works == []  # nothing before backward
        out.backward()
    assert len(works) == len(bufs)
    # the first layer's gradients land last: by then the earlier pieces were issued
    assert seen_during_backward and seen_during_backward[0] >= len(bufs) - 1
    for work in works:
        work.wait()
    # the hooks are gone: another backward issues nothing
    model(torch.randn(4, 32)).sum().backward()
    assert len(works) == len(bufs)


def test_timed_runs_interleave_and_average(one_rank: None) -> None:
    calls: list[str] = []
    means = _interleaved_means(
        [lambda: calls.append("a"), lambda: calls.append("b")], 3, lambda: None, torch.device("cpu")
    )
    # a warm-up of each, then the two in turn (at least 3 rounds; quick runs get more)
    assert calls[:4] == ["a", "b", "a", "b"]
    assert calls.count("a") == calls.count("b") >= 4
    assert len(means) == 2 and all(m >= 0 for m in means)


def test_the_overlap_share_counts_only_what_the_issue_order_let_compute_hide() -> None:
    # 100 ms of compute; 100 ms of collectives in 4 pieces issued as gradients land, at
    # 60, 70, 80 and 100 ms: at best they end at 160 ms (the last pieces wait for theirs)
    landed = [0.06, 0.07, 0.08, 0.10]
    assert overlap_share(0.1, 0.1, 0.16, landed) == pytest.approx(1.0)
    assert overlap_share(0.1, 0.1, 0.18, landed) == pytest.approx(0.5)
    assert overlap_share(0.1, 0.1, 0.20, landed) == pytest.approx(0.0)
    # sharing the device cost more than one after the other
    assert overlap_share(0.1, 0.1, 0.24, landed) == pytest.approx(-1.0)
    # one piece issued first: the shorter of the two can hide entirely
    assert overlap_share(0.1, 0.05, 0.1, [0.0]) == pytest.approx(1.0)


def test_the_overlap_rounds_count_by_what_each_could_hide() -> None:
    # a round whose pieces all landed at the end could hide almost nothing: its ratio is
    # noise, and counts for almost nothing
    landed_late = [0.099] * 4
    assert hideable(0.1, 0.1, landed_late) == pytest.approx(0.001)
    shares = [-40.0, 0.8, 0.9, 0.7, -0.2]
    weights = [0.001, 0.04, 0.04, 0.04, 0.005]
    assert weighted_median(shares, weights) == pytest.approx(0.8)
    assert weighted_median([3.0, 1.0, 2.0], [0.0, 0.0, 0.0]) == pytest.approx(2.0)


def test_one_slow_size_sets_only_its_own_segments() -> None:
    small, mid, large = FIT_SIZES
    huge = 24 << 20
    # the middle size hit a slow spell: 2.9 ms where ~0.5 ms was due
    fit = Fit.through_all([(small, 1.1e-3), (mid, 2.9e-3), (large, 3.9e-3), (huge, 18.9e-3)])
    assert fit.seconds(large) == pytest.approx(3.9e-3)
    assert fit.seconds(huge) == pytest.approx(18.9e-3)
    assert fit.seconds(48 << 20) == pytest.approx(18.9e-3 + 15e-3 / (huge - large) * (24 << 20))
    # a larger buffer never costs less than a smaller one timed
    dipped = Fit.through_all([(small, 1.0e-3), (mid, 3.0e-3), (large, 2.0e-3)])
    assert dipped.seconds(large) == pytest.approx(3.0e-3)
    assert dipped.seconds(2 * large) >= dipped.seconds(large)


def test_the_overlap_times_the_all_reduce_a_step_would_pick(one_rank: None) -> None:
    runtime: Any = SimpleNamespace(
        device=torch.device("cpu"), handle=SimpleNamespace(synchronize=lambda: None)
    )
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    def step() -> None:
        model(torch.randn(4, 16)).sum().backward()

    started: list[int] = []

    def other(buf: torch.Tensor) -> Any:
        started.append(buf.numel())
        return dist.all_reduce(buf, async_op=True)

    flat = Fit(1e-4, 1e-9)
    # the other algorithm is slower at every size: the flat one is timed
    measure_overlap(runtime, flat, 2, step, list(model.parameters()), [(Fit(1e-3, 1e-8), other)])
    assert started == []
    # the other is faster (the hierarchical one across slow hosts): it is the one timed
    measure_overlap(runtime, flat, 2, step, list(model.parameters()), [(Fit(1e-5, 1e-10), other)])
    assert len(started) >= 8
