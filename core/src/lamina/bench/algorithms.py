"""``lamina bench collectives --algorithm``: each all-reduce algorithm timed beside the
cost model's prediction.

Every rank builds the algorithms' groups from the job's topology (host names: an
interleaved launch is laid out correctly), calibrates the cost model on the job
(:func:`lamina.comm.calibrate.calibrate`, at sizes of its own) unless told not to, then
for each size times every requested algorithm, the algorithms taking turns round by
round so that drift in the machine's load hits them alike. The time of an algorithm is
the slowest rank's median; ``auto`` is the model's choice at that size. Where the
hierarchical algorithms run, an ``inter-phase`` row times their cross-host phase alone:
the bound a pipelined schedule approaches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.calibrate import calibrate
from lamina.comm.cost import ALGORITHMS, CostModel
from lamina.comm.layout import HostLayout
from lamina.device.topology import Topology
from lamina.errors import ConfigError
from lamina.trace.events import busbw_factor

#: The row that times the cross-host phase of the hierarchical algorithms alone (every
#: cross-host group all-reducing its 1/L share at once): what they approach.
INTER_PHASE = "inter-phase"
#: What ``--algorithm`` accepts.
ALGORITHM_CHOICES: tuple[str, ...] = (*ALGORITHMS, "auto", "all")


@dataclass(frozen=True)
class AlgorithmResult:
    """One algorithm at one size: measured and predicted."""

    algorithm: str
    chosen: str
    chunks: int
    bytes: int
    ranks: int
    time_us: float
    busbw_gbps: float
    predicted_us: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_us - self.time_us) / self.time_us

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {**asdict(self), "error": self.error}


def requested(names: Sequence[str]) -> list[str]:
    """The algorithms to time, in table order (``all``: every one and ``auto``)."""
    unknown = [n for n in names if n not in ALGORITHM_CHOICES]
    if unknown:
        raise ConfigError(f"--algorithm {unknown} unknown; choose from {list(ALGORITHM_CHOICES)}")
    if "all" in names:
        return [*ALGORITHMS, "auto"]
    return [a for a in (*ALGORITHMS, "auto") if a in names]


HEADER = (
    f"{'size(B)':>12} {'algorithm':>13} {'chunks':>6} {'time(us)':>12} {'busbw(GB/s)':>12} "
    f"{'model(us)':>12} {'error':>7}"
)


def format_row(result: AlgorithmResult) -> str:
    """One table row."""
    name = result.algorithm if result.algorithm != "auto" else f"auto={result.chosen}"
    return (
        f"{result.bytes:>12} {name:>13} {result.chunks:>6} {result.time_us:>12.1f} "
        f"{result.busbw_gbps:>12.4f} {result.predicted_us:>12.1f} {result.error:>+7.1%}"
    )


def sweep(
    topology: Topology,
    rank: int,
    pg_backend: str,
    names: Sequence[str],
    sizes: Sequence[int],
    *,
    iters: int,
    warmup: int,
    device: torch.device,
    sync: Callable[[], None],
    say: Callable[[str], None],
    calibrated: bool = True,
) -> tuple[CostModel, list[AlgorithmResult]]:
    """Time ``names`` at every size (see the module docstring)."""
    layout = HostLayout.of(topology)
    groups = AlgorithmGroups(layout, rank, pg_backend=pg_backend)
    try:
        model = CostModel.from_topology(topology)
        if calibrated:
            model = calibrate(groups, model, device=device, sync=sync)
        say(f"cost model: {model.describe()}")
        for name, why in sorted(groups.unavailable.items()):
            say(f"  {name}: not available ({why})")
        say(HEADER)
        results: list[AlgorithmResult] = []
        runnable = [n for n in requested(names) if n not in groups.unavailable]
        for nbytes in sizes:
            results += _one_size(groups, model, runnable, nbytes, iters, warmup, device, sync)
            for result in results[-len(runnable) :]:
                say(format_row(result))
        return model, results
    finally:
        groups.close()


def _one_size(
    groups: AlgorithmGroups,
    model: CostModel,
    names: Sequence[str],
    nbytes: int,
    iters: int,
    warmup: int,
    device: torch.device,
    sync: Callable[[], None],
) -> list[AlgorithmResult]:
    numel = max(1, nbytes // 4)
    buf = torch.zeros(numel, device=device)
    plans: dict[str, tuple[str, int, float]] = {}
    for name in names:
        prediction = (
            model.choose(numel * 4, groups.available())
            if name == "auto"
            else (model.predict(name, numel * 4))
        )
        plans[name] = (prediction.algorithm, prediction.chunks, prediction.seconds)
    names = list(names)
    if groups.inter is not None:  # the bound the hierarchical algorithms approach
        names.append(INTER_PHASE)
        _, inter, _ = model.phases(numel * 4)
        plans[INTER_PHASE] = (INTER_PHASE, 1, inter)
    shard = torch.zeros(numel // groups.layout.per_host, device=device)
    times: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(warmup + iters):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            algorithm, chunks, _ = plans[name]
            dist.barrier()
            start = time.perf_counter()
            if name == INTER_PHASE:
                dist.all_reduce(shard, group=groups.inter)
            else:
                groups.all_reduce(algorithm, buf, chunks).wait()
            sync()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    out = []
    ranks = groups.layout.size
    for name in names:
        slowest = torch.tensor([statistics.median(times[name])], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = max(float(slowest.item()), 1e-9)
        algorithm, chunks, predicted = plans[name]
        busbw = numel * 4 / seconds / 1e9 * busbw_factor("all_reduce", ranks)
        out.append(
            AlgorithmResult(
                name, algorithm, chunks, numel * 4, ranks, seconds * 1e6, busbw, predicted * 1e6
            )
        )
    return out
