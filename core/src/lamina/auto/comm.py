"""What each collective a candidate issues costs: :class:`CommCosts`.

Two sources, one interface (``seconds(op, axes, nbytes)``; ``op`` one of :data:`OPS`,
``axes`` the mesh axes of the group, ``nbytes`` the whole buffer: the tensor an
all-reduce sums, the unit an all-gather fills, the message a pipeline sends):

- :class:`MeasuredComm` (a running job): every op timed on the job's own groups, at
  :data:`FIT_SIZES` (and a larger size where that is quick), every group of those axes
  at once (as in a step), the slowest rank's mean; straight lines through consecutive
  points give the op's latency and seconds per byte on that group (an alpha-beta fit
  per op and group, piecewise). The gathers and reduce-scatters run in the form the
  sharded engines use on this backend
  (:func:`lamina.runtime.primitives.choose_primitive`), with the data movement around
  them that the engines do (a fresh buffer, the copy into the unsharded layout, the
  gradients copied into the reduce-scatter's input); a whole-job all-reduce on
  several hosts also times the hierarchical algorithm and costs the faster one, as
  ``dp``'s cost model picks per bucket;
- :class:`ClusterComm` (a declared cluster, ``lamina plan --simulate``): the formulas of
  :mod:`lamina.simulate.timing` on the cluster's groups.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from lamina.errors import ConfigError

if TYPE_CHECKING:
    from lamina.comm.layout import HostLayout
    from lamina.session import Runtime
    from lamina.simulate.cluster import Cluster

#: ``nbytes -> run``: one call of an op on one group moving ``nbytes`` (its buffers
#: made once, outside the call).
Timer = Callable[[int], Callable[[], object]]
#: ``buffer -> work``: an all-reduce of the whole job started (``wait()`` finishes it).
AllReduceStart = Callable[[torch.Tensor], Any]
#: The ops a candidate's step issues.
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "send")
#: Buffer sizes (bytes) each op is timed at: a small one (what a tiny collective costs
#: is timed, not extrapolated: tensor parallelism issues many), then two to fit bytes by.
FIT_SIZES: tuple[int, ...] = (16 << 10, 256 << 10, 4 << 20)
#: A larger size each op is also timed at where the first two predict it takes at most
#: :data:`LARGE_FIT_BUDGET_S` on every rank (large buffers miss the caches: a fit through
#: small ones prices them too cheap; on slow links it would take too long to time).
LARGE_FIT_SIZE = 24 << 20
LARGE_FIT_BUDGET_S = 0.15
#: Timed calls per size (after a warm-up; the sizes interleaved, so that a slow spell of
#: a shared machine hits them alike), of which the mean counts: a step issues many
#: collectives and pays their mean (on a shared machine a few take several times the
#: median), where one measured step's compute is priced by its median.
FIT_RUNS = 5
#: More timed calls, up to :data:`FIT_MAX_RUNS`, where they take at most this (seconds):
#: small buffers are quick, and their mean the noisiest.
FIT_BUDGET_S = 0.25
FIT_MAX_RUNS = 25
#: Times the overlap share is measured (compute, collective, both; interleaved), of
#: which the median counts: one measurement swings from none to all on a shared machine.
OVERLAP_ROUNDS = 5
#: The least overlap share: the collectives beside compute cost at most ``1 - this``
#: times their time alone (ranks sharing cores wait for the scheduler at every hop).
OVERLAP_FLOOR = -5.0
#: Pieces the overlap's all-reduce is cut into when issued as gradients land.
OVERLAP_BUCKETS = 8
#: Rounds of compute and a blocking collective :func:`measure_skew` times.
SKEW_ROUNDS = 16


class CommCosts(Protocol):
    """Seconds of one collective on the group over some mesh axes."""

    def seconds(self, op: str, axes: tuple[str, ...], nbytes: float) -> float:
        """Seconds of ``op`` moving a ``nbytes`` buffer over the group of ``axes``."""
        ...

    def describe(self) -> list[str]:
        """Lines saying where the figures come from."""
        ...

    @property
    def overlap(self) -> float:
        """The share of a collective's time compute can hide (0 to 1)."""
        ...

    @property
    def skew(self) -> float:
        """Seconds a blocking collective waits for the last rank, beyond its own time."""
        ...


@dataclass(frozen=True)
class Fit:
    """``alpha + beta x bytes`` seconds up to the next segment's first byte count, then
    that segment's line (``beyond``: ``(from bytes, alpha, beta)`` in order): the line
    through the timed points on each side, so a large buffer is priced by what large
    buffers measured (past the caches, a byte costs more)."""

    alpha: float
    beta: float
    beyond: tuple[tuple[float, float, float], ...] = ()

    def seconds(self, nbytes: float) -> float:
        """The fitted time of ``nbytes``."""
        alpha, beta = self.alpha, self.beta
        for start, a, b in self.beyond:
            if nbytes > start:
                alpha, beta = a, b
        return alpha + beta * nbytes

    @property
    def large_beta(self) -> float:
        """Seconds per byte of the largest buffers timed."""
        return self.beyond[-1][2] if self.beyond else self.beta

    @classmethod
    def through(cls, small: tuple[float, float], large: tuple[float, float]) -> Fit:
        """The line through two (bytes, seconds) points (never negative)."""
        (x0, t0), (x1, t1) = small, large
        beta = max((t1 - t0) / (x1 - x0), 0.0)
        return cls(max(t0 - beta * x0, 0.0), beta)

    @classmethod
    def through_all(cls, points: list[tuple[float, float]]) -> Fit:
        """The lines through consecutive (bytes, seconds) points, in byte order, each
        point's time raised to the largest timed at a smaller size (a larger buffer never
        costs less). Each segment is bounded by its own two points: a slow spell at one
        size sets the slope between its neighbours, not the price of every larger size
        (an extrapolated first line once priced 24 MiB at 31 ms where it measured 19)."""
        points = sorted(points)
        highest = itertools.accumulate((t for _, t in points), max)
        raised = [(x, t) for (x, _), t in zip(points, highest, strict=True)]
        first = cls.through(raised[0], raised[1])
        beyond = []
        for (x0, t0), (x1, t1) in itertools.pairwise(raised[1:]):
            line = cls.through((x0, t0), (x1, t1))
            beyond.append((x0, line.alpha, line.beta))
        return cls(first.alpha, first.beta, tuple(beyond))


class MeasuredComm:
    """Fits timed on the running job (see the module)."""

    def __init__(
        self,
        fits: dict[tuple[str, tuple[str, ...]], Fit],
        sizes: dict[tuple[str, ...], int],
        overlap: float = 1.0,
        skew: float = 0.0,
    ) -> None:
        self.fits = fits
        self.sizes = sizes
        self.overlap = overlap
        self.skew = skew

    def seconds(self, op: str, axes: tuple[str, ...], nbytes: float) -> float:
        """Seconds of ``op`` over ``axes`` (0 for a group of one rank)."""
        if nbytes <= 0 or self.sizes.get(axes, 1) < 2:
            return 0.0
        options = [f for (o, a), f in self.fits.items() if a == axes and o.split(":")[0] == op]
        if not options:
            raise ConfigError(f"no timing of {op} over axes {list(axes)}; calibrate those axes")
        return min(f.seconds(nbytes) for f in options)

    def describe(self) -> list[str]:
        """One line per fitted op and group, and the overlap measured."""
        return [
            f"communication hidden behind compute: {self.overlap:.0%}, a blocking "
            f"collective's wait for the last rank: {self.skew * 1e3:.2f} ms (measured)"
        ] + [
            f"{op} over {'+'.join(axes)} ({self.sizes[axes]} ranks): "
            f"{fit.alpha * 1e6:.0f} us + {fit.beta * 1e9:.3f} ns/B"
            f" ({1 / fit.beta / 1e9 if fit.beta > 0 else float('inf'):.2f} GB/s)"
            + (
                f", past {fit.beyond[-1][0] / 2**20:.0f} MiB {fit.large_beta * 1e9:.3f} ns/B"
                if fit.beyond
                else ""
            )
            for (op, axes), fit in sorted(self.fits.items())
        ]

    @classmethod
    def calibrate(
        cls,
        runtime: Runtime,
        groups: Iterable[tuple[str, ...]],
        sizes: tuple[int, ...] = FIT_SIZES,
        runs: int = FIT_RUNS,
        compute: Callable[[], None] | None = None,
        parameters: Sequence[torch.Tensor] = (),
    ) -> MeasuredComm:
        """Time every op on the group of each axes tuple of ``groups`` (collective: every
        rank calls it with the same groups), and the overlap share against ``compute``
        (the model's forward + backward, reaching ``parameters``; default: matrix
        products)."""
        from lamina.comm.layout import HostLayout

        mesh = runtime.mesh
        ordered = sorted({tuple(a for a in mesh.axis_names if a in g) for g in groups})
        points: list[tuple[str, tuple[str, ...], list[tuple[float, float]]]] = []
        group_sizes: dict[tuple[str, ...], int] = {}
        hierarchical: AllReduceStart | None = None
        for axes in ordered:
            group, ranks = mesh.group_over(axes)
            group_sizes[axes] = len(ranks)
            if len(ranks) < 2:
                continue
            timers = _op_timers(runtime, group, ranks)
            if len(axes) == len(mesh.axis_names):
                layout = HostLayout.of(runtime.topology)
                if layout.host_count > 1 and layout.per_host > 1:
                    hierarchical = _hierarchical(runtime, layout)
                    timers["all_reduce:hierarchical"] = _timer_of(
                        hierarchical, layout.size, runtime.device
                    )
            sync = runtime.handle.synchronize
            for op, timer in timers.items():
                timed = _interleaved_means([timer(n) for n in sizes], runs, sync, runtime.device)
                timed = _slowest(timed, runtime.device)
                op_points = [(float(n), t) for n, t in zip(sizes, timed, strict=True)]
                line = Fit.through(*op_points[-2:])
                if line.seconds(LARGE_FIT_SIZE) <= LARGE_FIT_BUDGET_S:  # agreed: slowest
                    large = _interleaved_means([timer(LARGE_FIT_SIZE)], runs, sync, runtime.device)
                    op_points.append((float(LARGE_FIT_SIZE), _slowest(large, runtime.device)[0]))
                points.append((op, axes, op_points))
        fits = {(op, axes): Fit.through_all(found) for op, axes, found in points}
        whole = tuple(mesh.axis_names)
        overlap, skew = 1.0, 0.0
        if runtime.world_size > 1:
            others = []  # the step's all-reduce may be the hierarchical one: measured too
            if hierarchical is not None and ("all_reduce:hierarchical", whole) in fits:
                others.append((fits["all_reduce:hierarchical", whole], hierarchical))
            overlap = measure_overlap(
                runtime, fits.get(("all_reduce", whole)), runs, compute, parameters, others
            )
            skew = measure_skew(runtime, runs)
        return cls(fits, group_sizes, overlap, skew)


def measure_overlap(
    runtime: Runtime,
    fit: Fit | None,
    runs: int = FIT_RUNS,
    compute: Callable[[], None] | None = None,
    parameters: Sequence[torch.Tensor] = (),
    others: Sequence[tuple[Fit, AllReduceStart]] = (),
) -> float:
    """The share of what compute could hide of a collective that it does hide:
    ``compute`` (the model's forward + backward: its autograd holds the interpreter as a
    real step does; default: matrix products) timed alone, all-reduces over the job about
    as long together (sized by its ``fit``) timed alone, then both at once:
    ``(t_comm + t_compute - t_both) / (t_comm + t_compute - t_ideal)``, where
    ``t_ideal`` is both at once with nothing lost to sharing the device: each piece
    started when its gradients were there in the compute alone (or when the one before
    it finished), at its time alone. The
    median of :data:`OVERLAP_ROUNDS` interleaved measurements, each weighed by what it
    could hide (:func:`weighted_median`), the ranks' mean, in [:data:`OVERLAP_FLOOR`, 1].
    With ``parameters`` (the model's, that ``compute``'s backward reaches) the
    all-reduces are :data:`OVERLAP_BUCKETS` pieces, each issued as backward has produced
    its share of the gradients, as data parallelism issues its buckets; otherwise one,
    issued first. What the issue order itself leaves unhidden (a piece can start no
    earlier than its gradients) is the step simulation's to price (it schedules over the
    plan's edges): the share measures only what sharing the device costs. Accelerators
    with a communication stream hide nearly all of it; CPU ranks sharing their cores
    with the collective's threads hide little, or less than nothing: below 0, running
    both at once costs more than one after the other. ``others``: other all-reduce
    algorithms over the job with their fits (the hierarchical one); the one a step would
    run at the timed size (the fastest by its fit) is the one timed, since each shares
    the device its own way (the hierarchical one also sums inside the host)."""
    device, sync = runtime.device, runtime.handle.synchronize
    if compute is None:
        a = torch.randn(256, 256, device=device)

        def products() -> None:
            for _ in range(64):
                a @ a

        compute = products
    work_load = compute
    alone = _mean_over_ranks(_median_seconds(work_load, runs, sync), device)  # one size

    def as_long_as_compute(fit: Fit | None) -> int:  # the ratio is steadiest
        if fit is None or fit.beta <= 0:
            return 4 << 20
        return int(min(64 << 20, max(64 << 10, (alone - fit.alpha) / fit.beta)))

    nbytes = as_long_as_compute(fit)
    start: AllReduceStart = _flat_all_reduce
    cheaper = [o for o in others if fit is None or o[0].seconds(nbytes) < fit.seconds(nbytes)]
    if cheaper:  # the algorithm the step would pick at this size
        fit, start = min(cheaper, key=lambda o: o[0].seconds(nbytes))
        nbytes = as_long_as_compute(fit)
    trainable = [p for p in parameters if p.requires_grad]
    pieces = OVERLAP_BUCKETS if trainable else 1
    bufs = [torch.zeros(max(1, nbytes // 4 // pieces), device=device) for _ in range(pieces)]
    landed: list[float] = []

    def compute_alone() -> None:  # when each piece's gradients were there, alone
        landed.clear()
        if not trainable:
            work_load()
            return
        with _issued_as_gradients_land(trainable, bufs, [], landed, reduce=False):
            work_load()

    def collectives() -> None:
        for buf in bufs:
            start(buf).wait()

    def both() -> None:
        works: list[Any] = []
        if not trainable:
            works.append(start(bufs[0]))
            work_load()
        else:
            with _issued_as_gradients_land(trainable, bufs, works, start=start):
                work_load()
            while len(works) < len(bufs):  # a parameter backward did not reach
                works.append(start(bufs[len(works)]))
        for work in works:
            work.wait()

    for run in (compute_alone, collectives, both):  # warm-up
        run()
        sync()
    shares, weights = [], []
    for _ in range(OVERLAP_ROUNDS):  # interleaved: a slow spell hits all three alike
        began = time.perf_counter()
        t_compute = _seconds(compute_alone, sync)
        offsets = [at - began for at in landed] if trainable else [0.0]
        offsets += [t_compute] * (pieces - len(offsets))  # pieces backward did not reach
        t_comm = _seconds(collectives, sync)
        joint = _seconds(both, sync)
        shares.append(overlap_share(t_compute, t_comm, joint, offsets))
        weights.append(hideable(t_compute, t_comm, offsets))
    # each round weighed by what it could hide: where the pieces land late, little can
    # be, and the ratio of two small differences is noise
    hidden = weighted_median(shares, weights)
    return _mean_over_ranks(min(1.0, max(OVERLAP_FLOOR, hidden)), device)


def overlap_share(compute_s: float, comm_s: float, both_s: float, issued: list[float]) -> float:
    """The share of what compute could hide of ``comm_s`` that it hid, ``both_s`` being
    the two at once with the collective's pieces issued ``issued`` seconds after the
    compute began: against both one after the other (0) and both with nothing lost to
    sharing the device (1: each piece at its time alone, started when issued or when
    the one before it finished). Below 0 where both at once took longer than one after
    the other."""
    return (compute_s + comm_s - both_s) / max(hideable(compute_s, comm_s, issued), 1e-9)


def hideable(compute_s: float, comm_s: float, issued: list[float]) -> float:
    """Seconds of ``comm_s`` that compute could hide at best, its pieces issued
    ``issued`` seconds after the compute began (see :func:`overlap_share`)."""
    piece = comm_s / max(1, len(issued))
    chain = 0.0
    for at in issued:
        chain = max(chain, at) + piece
    return compute_s + comm_s - max(compute_s, chain)


def weighted_median(values: list[float], weights: list[float]) -> float:
    """The value at half the total weight, in value order (negative weights count 0; all
    zero: the plain median)."""
    pairs = sorted(zip(values, (max(0.0, w) for w in weights), strict=True))
    total = sum(w for _, w in pairs)
    if total <= 0:
        return statistics.median(values)
    seen = 0.0
    for value, weight in pairs:
        seen += weight
        if seen >= total / 2:
            return value
    return pairs[-1][0]


@contextmanager
def _issued_as_gradients_land(
    parameters: list[torch.Tensor],
    bufs: list[torch.Tensor],
    works: list[Any],
    landed_at: list[float] | None = None,
    reduce: bool = True,
    start: AllReduceStart | None = None,
) -> Iterator[None]:
    """While inside, each of ``bufs`` is all-reduced (started by ``start``, default the
    backend's own all-reduce, into ``works``) once backward has accumulated its share of
    the gradients of ``parameters``; the moment each share was there goes into
    ``landed_at`` (without ``reduce``, only that)."""
    begin = start or _flat_all_reduce
    total = sum(p.numel() for p in parameters)
    landed = [0]
    shares: list[float] = landed_at if landed_at is not None else []

    def landed_one(param: torch.Tensor) -> None:
        landed[0] += param.numel()
        while len(shares) < len(bufs) and landed[0] * len(bufs) >= total * (len(shares) + 1):
            if reduce:
                works.append(begin(bufs[len(works)]))
            shares.append(time.perf_counter())

    handles = [
        p.register_post_accumulate_grad_hook(landed_one)  # type: ignore[no-untyped-call]
        for p in parameters
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _seconds(run: Callable[[], object], sync: Callable[[], None]) -> float:
    """One timed call of ``run``."""
    start = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - start


def measure_skew(runtime: Runtime, runs: int = FIT_RUNS) -> float:
    """Seconds a blocking collective costs beyond its own time in a step: the ranks
    reach it at different moments (a shared machine gives them uneven shares), and the
    first wait for the last. Timed as :data:`SKEW_ROUNDS` rounds of a short compute each
    followed by a one-element all-reduce, against the same rounds without it and the
    all-reduces alone; the ranks' mean, never below 0."""
    device, sync = runtime.device, runtime.handle.synchronize
    a = torch.randn(128, 128, device=device)
    one = torch.zeros(1, device=device)

    def compute() -> None:
        for _ in range(16):
            a @ a

    def rounds(with_sync: bool, with_compute: bool = True) -> None:
        for _ in range(SKEW_ROUNDS):
            if with_compute:
                compute()
            if with_sync:
                dist.all_reduce(one)

    synced = _median_seconds(lambda: rounds(True), runs, sync)
    alone = _median_seconds(lambda: rounds(False), runs, sync)
    collectives = _median_seconds(lambda: rounds(True, False), runs, sync)
    extra = (synced - alone - collectives) / SKEW_ROUNDS
    return _mean_over_ranks(max(0.0, extra), device)


def _slowest(times: list[float], device: torch.device) -> list[float]:
    """Each of ``times`` as the slowest rank measured it (collective: every rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return times
    tensor = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(t) for t in tensor.tolist()]


def _mean_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def _median_seconds(run: Callable[[], object], runs: int, sync: Callable[[], None]) -> float:
    run()
    sync()
    times = []
    for _ in range(runs):
        dist.barrier()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_means(
    runs: list[Callable[[], object]], rounds: int, sync: Callable[[], None], device: torch.device
) -> list[float]:
    """The mean seconds of each of ``runs`` (collective: every rank the same list),
    each warmed up once, then timed in turn: ``rounds`` times, or more, up to
    :data:`FIT_MAX_RUNS`, where the warm-up says they fit in :data:`FIT_BUDGET_S` (the
    slowest rank's warm-up decides, so every rank issues the same calls)."""
    start = time.perf_counter()
    for run in runs:
        run()
        sync()
    warm = _slowest([time.perf_counter() - start], device)[0]
    rounds = max(rounds, min(FIT_MAX_RUNS, int(FIT_BUDGET_S / max(warm, 1e-6))))
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, timed in zip(runs, times, strict=True):
            dist.barrier()
            start = time.perf_counter()
            run()
            sync()
            timed.append(time.perf_counter() - start)
    return [statistics.fmean(t) for t in times]


def _op_timers(
    runtime: Runtime, group: dist.ProcessGroup | None, ranks: tuple[int, ...]
) -> dict[str, Timer]:
    """A :data:`Timer` per op over ``group``."""
    from lamina.memory.gather import gather_full, reduce_scatter_start
    from lamina.runtime.primitives import choose_primitive

    device = runtime.device
    size = len(ranks)
    me = ranks.index(runtime.rank)
    pg_backend = runtime.backend.collective_backend
    unsupported = tuple(getattr(runtime.backend, "unsupported_collectives", ()) or ())

    def primitive(op: str) -> str:
        choice = choose_primitive(op, pg_backend, unsupported=unsupported, group_size=size)
        return {"all_gather": "native", "reduce_scatter": "native"}.get(choice.op, choice.op)

    gather_form, scatter_form = primitive("all_gather"), primitive("reduce_scatter")

    def numel(nbytes: int) -> int:
        return max(size, nbytes // 4 // size * size)

    def all_reduce(nbytes: int) -> Callable[[], object]:
        buf = torch.zeros(numel(nbytes), device=device)
        return lambda: dist.all_reduce(buf, group=group)

    def all_gather(nbytes: int) -> Callable[[], object]:
        # as a ZeRO-3 unit's gather runs: a fresh buffer, the gather, and (but for the
        # all-reduce form, which gathers in place) the copy into the unsharded layout
        numel_ = numel(nbytes)
        shard = torch.zeros(numel_ // size, device=device)

        def run() -> None:
            full = torch.empty(numel_, device=device)
            work = gather_full(shard, full, me, gather_form, group, async_op=True)  # type: ignore[arg-type]
            if work is not None:
                work.wait()
            if gather_form != "all_reduce":
                torch.empty_like(full).copy_(full)

        return run

    def reduce_scatter(nbytes: int) -> Callable[[], object]:
        # as a ZeRO-3 unit's reduce-scatter runs: its gradients copied into a fresh input
        grads = torch.zeros(numel(nbytes), device=device)

        def run() -> None:
            buf = torch.empty_like(grads).copy_(grads)
            work, finish = reduce_scatter_start(buf, me, size, scatter_form, group)  # type: ignore[arg-type]
            if work is not None:
                work.wait()
            finish()

        return run

    def send(nbytes: int) -> Callable[[], object]:
        buf = torch.zeros(max(1, nbytes // 4), device=device)
        # neighbours along the group exchange one message: 0 -> 1, 2 -> 3, ...
        peer = me + 1 if me % 2 == 0 else me - 1

        def run() -> None:
            if peer >= size:
                return
            if me % 2 == 0:
                dist.send(buf, ranks[peer])
            else:
                dist.recv(buf, ranks[peer])

        return run

    return {
        "all_reduce": all_reduce,
        "all_gather": all_gather,
        "reduce_scatter": reduce_scatter,
        "send": send,
    }


def _flat_all_reduce(buf: torch.Tensor) -> Any:
    """The backend's own all-reduce of ``buf`` over the job, started."""
    return dist.all_reduce(buf, async_op=True)


def _timer_of(start: AllReduceStart, ranks: int, device: torch.device) -> Timer:
    """A :data:`Timer` of the all-reduce ``start`` begins (over ``ranks`` ranks)."""

    def timer(nbytes: int) -> Callable[[], object]:
        buf = torch.zeros(max(ranks, nbytes // 4), device=device)
        return lambda: start(buf).wait()

    return timer


def _hierarchical(runtime: Runtime, layout: HostLayout) -> AllReduceStart:
    """The hierarchical all-reduce over the whole job on ``layout``, as it starts."""
    from lamina.comm.algorithms import AlgorithmGroups

    groups = AlgorithmGroups(
        layout,
        runtime.rank,
        pg_backend=runtime.backend.collective_backend,
        needed=("hierarchical",),
    )

    return lambda buf: groups.all_reduce("hierarchical", buf)


class ClusterComm:
    """The declared cluster's alpha-beta formulas (:mod:`lamina.simulate.timing`) on the
    group of each axes tuple of its mesh; its devices are taken to hide communication
    behind compute (a communication stream), as accelerators do, and to reach each
    collective together (no skew)."""

    overlap = 1.0
    skew = 0.0

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._groups: dict[tuple[str, ...], object] = {}

    def _group(self, axes: tuple[str, ...]) -> object:
        from lamina.simulate.groups import Group

        if axes not in self._groups:
            hosts, per_host = self.cluster.mesh_group(axes)
            whole = len(axes) == len(self.cluster.mesh)
            model = self.cluster.group_model(hosts, per_host)
            self._groups[axes] = Group("+".join(axes), model, whole, axes)
        return self._groups[axes]

    def seconds(self, op: str, axes: tuple[str, ...], nbytes: float) -> float:
        """Seconds of ``op`` over ``axes`` on the cluster."""
        from lamina.simulate.groups import Group

        group = self._group(axes)
        assert isinstance(group, Group)
        if nbytes <= 0 or group.size < 2:
            return 0.0
        n = int(nbytes)
        if op == "all_reduce":
            phases = group.all_reduce(n)[2]
        elif op in ("all_gather", "reduce_scatter"):
            phases = group.ring_half(n, op)
        elif op == "send":
            link = group.model.inter if group.model.layout.host_count > 1 else group.model.intra
            return link.time(n)
        else:
            raise ConfigError(f"collective {op!r} has no model; use one of {list(OPS)}")
        return sum(p.seconds for p in phases)

    def describe(self) -> list[str]:
        """The cluster, as ``lamina plan --simulate`` prints it."""
        return self.cluster.describe().splitlines()


__all__ = ["FIT_RUNS", "FIT_SIZES", "OPS", "ClusterComm", "CommCosts", "Fit", "MeasuredComm"]
