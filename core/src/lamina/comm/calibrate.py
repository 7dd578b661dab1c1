"""Calibrate the cost model on the job itself: time the phases, fit alpha and beta.

Two fits, each from timings at two sizes (every rank takes part; the time of a size is
the slowest rank's median):

- *intra*: the intra-host reduce-scatter and all-gather of the hierarchical algorithm,
  every host at once: ``2(L-1)`` steps of ``n/L`` bytes;
- *inter*: the cross-host all-reduce of ``m`` bytes in every cross-host group at once
  (the ``L`` flows share each uplink, as they do inside the hierarchical algorithm):
  ``2(H-1)`` steps of ``m/H`` bytes, ``L`` flows per uplink.

A straight line through the two points gives each class's ``alpha`` (per message) and
``beta`` (per byte). Where the group has no hierarchy (one host, or one rank per host)
the flat all-reduce is timed instead and gives the one class it crosses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.cost import CostModel, LinkCost

#: Sizes (bytes of the buffer a phase starts from) timed by default: the intra-host
#: phases (and the flat all-reduce) and the cross-host all-reduce. The intra-host phases
#: are fast, so they are timed on larger buffers to stand above scheduling noise.
INTRA_SIZES: tuple[int, int] = (4 << 20, 16 << 20)
INTER_SIZES: tuple[int, int] = (1 << 20, 4 << 20)
#: Calls timed back to back per sample.
BATCH = 3
#: Smallest alpha a fit may give (a negative intercept is noise).
MIN_ALPHA_S = 1e-6


def _slowest_median(
    call: Callable[[], None], iters: int, sync: Callable[[], None], device: torch.device
) -> float:
    """Seconds per call: ``iters`` samples of :data:`BATCH` calls back to back (a call
    timed alone after a barrier carries the ranks' uneven wake-up), the median sample,
    the slowest rank's."""
    call()  # warm-up: connections, allocations
    sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(BATCH):
            call()
        sync()
        times.append((time.perf_counter() - start) / BATCH)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def fit(points: Sequence[tuple[float, float]], steps: float, bytes_per_step: float) -> LinkCost:
    """The link cost from (size, seconds) points of a phase that runs ``steps`` steps of
    ``bytes_per_step x size`` bytes each."""
    (x0, t0), (x1, t1) = points[0], points[-1]
    slope = (t1 - t0) / (x1 - x0)
    intercept = t0 - slope * x0
    beta = max(slope / (steps * bytes_per_step), 1e-15)
    return LinkCost(max(intercept / steps, MIN_ALPHA_S), beta)


def calibrate(
    groups: AlgorithmGroups,
    model: CostModel,
    *,
    device: torch.device,
    sync: Callable[[], None],
    intra_sizes: Sequence[int] = INTRA_SIZES,
    inter_sizes: Sequence[int] = INTER_SIZES,
    iters: int = 3,
) -> CostModel:
    """``model`` with link costs fitted from phases timed on ``groups`` (every rank of
    the group calls it)."""
    layout = groups.layout
    hosts, local = layout.host_count, layout.per_host
    if "hierarchical" in groups.unavailable:
        points = []
        for numel in _numels(intra_sizes, local):
            buf = torch.zeros(numel, device=device)

            def flat(b: torch.Tensor = buf) -> None:
                groups.all_reduce("flat", b).wait()

            seconds = _slowest_median(flat, iters, sync, device)
            points.append((numel * 4.0, seconds))
        ranks = layout.size
        cost = fit(points, 2 * (ranks - 1), 1.0 / ranks)
        if hosts == 1:
            return replace(model, intra=cost, source="calibrated")
        cost = fit(points, 2 * (ranks - 1), float(layout.crossings(layout.rank_order())) / ranks)
        return replace(model, inter=cost, source="calibrated")
    intra_points, inter_points = [], []
    for numel in _numels(intra_sizes, local):
        part = torch.zeros(numel, device=device)

        def intra(p: torch.Tensor = part) -> None:
            shard = groups.scatter_in_host(p)()
            groups.gather_in_host(p, shard).wait()

        intra_points.append((numel * 4.0, _slowest_median(intra, iters, sync, device)))
    for numel in _numels(inter_sizes, 1):
        shard = torch.zeros(numel, device=device)

        def inter(s: torch.Tensor = shard) -> None:
            dist.all_reduce(s, group=groups.inter)

        inter_points.append((numel * 4.0, _slowest_median(inter, iters, sync, device)))
    intra_cost = fit(intra_points, 2 * (local - 1), 1.0 / local)
    inter_cost = fit(inter_points, 2 * (hosts - 1), float(local) / hosts)
    return replace(model, intra=intra_cost, inter=inter_cost, source="calibrated")


def _numels(sizes: Sequence[int], multiple: int) -> list[int]:
    return [max(multiple, n // 4 // multiple * multiple) for n in sizes]
