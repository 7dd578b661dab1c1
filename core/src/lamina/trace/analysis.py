"""What a collective trace says: bandwidth per op and size, hidden vs exposed
communication per step, and which rank makes the others wait.

Pure functions over :class:`~lamina.trace.events.RankTrace` data (no torch). Conventions:

- **Size classes** are powers of two of the bytes an event moves: ``[2^k, 2^(k+1))``
  labelled ``"1 MiB-2 MiB"`` (the lower bound is included), and everything under 4 KiB
  in one class ``"<4 KiB"``.
- **Bandwidth** is computed per event (``algbw = bytes / seconds / 1e9`` GB/s, ``busbw =
  algbw * busbw_factor(op, group size)``), then the row reports the median of each, so
  groups of different sizes in one row are each scaled by their own factor. Only
  completed events with a positive duration count.
- **count** is rank-level events (one per rank that took part); **calls** is distinct
  collectives, i.e. distinct ``(group, seq)``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from lamina.trace.events import CollectiveEvent, RankTrace, busbw_factor, read_dir
from lamina.trace.expert_view import ExpertLoad, expert_load
from lamina.trace.intervals import overlap_ns, union
from lamina.trace.pipeline_view import PipelineStep, pipeline_by_step
from lamina.units import format_bytes

#: Events smaller than this share one size class.
SMALL_BYTES = 4096


class _Record:
    """A dataclass row that turns into JSON field by field."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return asdict(cast(Any, self))


class _Comm(_Record):
    """A row with ``comm_ns = hidden_ns + exposed_ns``; JSON adds both percentages."""

    comm_ns: int
    hidden_ns: int
    exposed_ns: int

    @property
    def hidden_pct(self) -> float:
        """Share of the communication time that ran under compute."""
        return 100.0 * self.hidden_ns / self.comm_ns if self.comm_ns else 0.0

    @property
    def exposed_pct(self) -> float:
        """Share of the communication time no compute covered."""
        return 100.0 * self.exposed_ns / self.comm_ns if self.comm_ns else 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready row with ``hidden_pct`` and ``exposed_pct``."""
        return {**super().to_json(), "hidden_pct": self.hidden_pct, "exposed_pct": self.exposed_pct}


def size_class(nbytes: int) -> tuple[int, int, str]:
    """``(low, high, label)`` of the power-of-two class that holds ``nbytes``."""
    if nbytes < SMALL_BYTES:
        return 0, SMALL_BYTES, f"<{format_bytes(SMALL_BYTES)}"
    low = 1 << (nbytes.bit_length() - 1)
    return low, 2 * low, f"{format_bytes(low)}-{format_bytes(2 * low)}"


@dataclass
class OpRow(_Record):
    """Timing and bandwidth of one op in one size class."""

    op: str
    size_class: str
    size_low: int
    count: int
    calls: int
    total_s: float
    median_s: float
    median_bytes: int
    algbw_gbs: float | None
    busbw_gbs: float | None


def _completed(traces: dict[int, RankTrace]) -> list[CollectiveEvent]:
    return [e for t in traces.values() for e in t.collectives if e.end_ns is not None]


def op_table(traces: dict[int, RankTrace]) -> list[OpRow]:
    """One row per (op, size class) of the completed collectives, by op then size."""
    groups: dict[tuple[str, int], list[CollectiveEvent]] = defaultdict(list)
    for event in _completed(traces):
        groups[(event.op, size_class(event.bytes)[0])].append(event)
    rows = []
    for (op, low), events in sorted(groups.items()):
        timed = [(e, (e.end_ns - e.issue_ns) / 1e9) for e in events if e.end_ns is not None]
        seconds = [s for _, s in timed]
        algbw = [(e.bytes / s / 1e9, len(e.group)) for e, s in timed if s > 0]
        busbw = [a * busbw_factor(op, n) for a, n in algbw]
        rows.append(
            OpRow(
                op=op,
                size_class=size_class(events[0].bytes)[2],
                size_low=low,
                count=len(events),
                calls=len({(e.group, e.seq) for e in events}),
                total_s=sum(seconds),
                median_s=statistics.median(seconds),
                median_bytes=int(statistics.median(e.bytes for e in events)),
                algbw_gbs=statistics.median(a for a, _ in algbw) if algbw else None,
                busbw_gbs=statistics.median(busbw) if busbw else None,
            )
        )
    return rows


# -- overlap ------------------------------------------------------------------------------
@dataclass
class StepOverlap(_Comm):
    """One rank's communication in one step: ``comm = hidden + exposed`` (ns)."""

    rank: int
    step: int
    wall_ns: int
    comm_ns: int
    hidden_ns: int
    exposed_ns: int


def _step_wall(trace: RankTrace, step: int) -> int:
    spans = [s for s in trace.spans if s.track == "step" and s.step == step]
    if not any(s.end_ns is not None for s in spans):  # no closed step span: event extent
        spans = [s for s in trace.spans if s.step == step]
        points = [p for e in trace.collectives if e.step == step for p in (e.issue_ns, e.end_ns)]
    else:
        points = []
    points += [p for s in spans if s.end_ns is not None for p in (s.start_ns, s.end_ns)]
    known = [p for p in points if p is not None]
    return max(known) - min(known) if known else 0


def overlap_by_step(traces: dict[int, RankTrace]) -> list[StepOverlap]:
    """Per rank and step: the union of completed collective intervals, split into the part
    the same rank's compute spans (forward/backward, any step) cover and the rest."""
    rows = []
    for rank, trace in sorted(traces.items()):
        compute = union(
            (s.start_ns, s.end_ns)
            for s in trace.spans
            if s.track == "compute" and s.end_ns is not None
        )
        steps = {e.step for e in trace.collectives} | {s.step for s in trace.spans}
        for step in sorted(steps):
            comm = union(
                (e.issue_ns, e.end_ns)
                for e in trace.collectives
                if e.step == step and e.end_ns is not None
            )
            total = sum(end - start for start, end in comm)
            hidden = overlap_ns(comm, compute)
            rows.append(
                StepOverlap(rank, step, _step_wall(trace, step), total, hidden, total - hidden)
            )
    return rows


@dataclass
class StepSummary(_Comm):
    """One step over all ranks: the slowest wall time, mean comm/hidden/exposed (ns)."""

    step: int
    ranks: int
    wall_ns: int
    comm_ns: int
    hidden_ns: int
    exposed_ns: int
    worst_rank: int
    worst_exposed_ns: int


def summarize_steps(rows: list[StepOverlap]) -> list[StepSummary]:
    """Fold per-rank overlap rows into one row per step."""
    by_step: dict[int, list[StepOverlap]] = defaultdict(list)
    for row in rows:
        by_step[row.step].append(row)
    out = []
    for step, group in sorted(by_step.items()):
        worst = max(group, key=lambda r: (r.exposed_ns, -r.rank))
        n = len(group)
        out.append(
            StepSummary(
                step,
                n,
                max(r.wall_ns for r in group),
                sum(r.comm_ns for r in group) // n,
                sum(r.hidden_ns for r in group) // n,
                sum(r.exposed_ns for r in group) // n,
                worst.rank,
                worst.exposed_ns,
            )
        )
    return out


# -- stragglers -------------------------------------------------------------------------
#: A rank whose mean lateness is under this is never named a straggler (clock noise).
MIN_LATENESS_NS = 100_000


@dataclass
class RankLateness(_Record):
    """How one rank entered the collectives it shared with others."""

    rank: int
    collectives: int
    times_last: int
    mean_lateness_ns: float


@dataclass
class Skew(_Record):
    """One collective's entry skew across the ranks that recorded it."""

    group: tuple[int, ...]
    seq: int
    node: str
    op: str
    skew_ns: int
    last_rank: int


@dataclass
class StragglerReport(_Record):
    """Entry skew over every collective seen by >= 2 ranks, and the rank(s) named late."""

    collectives: int
    median_skew_ns: float
    max_skew_ns: int
    ranks: list[RankLateness]
    stragglers: list[int]
    worst: list[Skew]


def stragglers(traces: dict[int, RankTrace], worst: int = 5) -> StragglerReport:
    """Match collectives across ranks by ``(group, seq)`` and measure who enters late.

    A rank is named a straggler when all of these hold: it entered last in the most
    collectives (ties name every such rank), and in at least half of those with a
    non-zero skew; its mean lateness (issue time minus the earliest rank's) is more than
    twice the median of the other ranks' mean lateness; and it is at least
    :data:`MIN_LATENESS_NS`. So a rank that is consistently and clearly late is named,
    while clock noise spread over all ranks is not. Issue times are wall clocks, so across
    hosts their offset (NTP keeps it to about a millisecond) adds to the skew.
    """
    matched: dict[tuple[tuple[int, ...], int], list[CollectiveEvent]] = defaultdict(list)
    for trace in traces.values():
        for event in trace.collectives:
            matched[(event.group, event.seq)].append(event)
    lateness: dict[int, list[int]] = defaultdict(list)
    last: dict[int, int] = defaultdict(int)
    skews: list[Skew] = []
    for (group, seq), events in sorted(matched.items()):
        if len({e.rank for e in events}) < 2:
            continue
        first = min(e.issue_ns for e in events)
        late = max(events, key=lambda e: (e.issue_ns, e.rank))
        skew = late.issue_ns - first
        for event in events:
            lateness[event.rank].append(event.issue_ns - first)
        if skew > 0:
            last[late.rank] += 1
        skews.append(Skew(group, seq, late.node, late.op, skew, late.rank))
    rows = [RankLateness(r, len(v), last[r], sum(v) / len(v)) for r, v in sorted(lateness.items())]
    skewed = sum(1 for s in skews if s.skew_ns > 0)
    most = max((r.times_last for r in rows), default=0)
    named = []
    for row in rows:
        others = [o.mean_lateness_ns for o in rows if o.rank != row.rank]
        if (
            most > 0
            and row.times_last == most
            and 2 * row.times_last >= skewed
            and row.mean_lateness_ns > 2 * statistics.median(others)
            and row.mean_lateness_ns >= MIN_LATENESS_NS
        ):
            named.append(row.rank)
    values = [s.skew_ns for s in skews]
    return StragglerReport(
        collectives=len(skews),
        median_skew_ns=statistics.median(values) if values else 0.0,
        max_skew_ns=max(values, default=0),
        ranks=rows,
        stragglers=named,
        worst=sorted(skews, key=lambda s: -s.skew_ns)[:worst],
    )


@dataclass
class TraceReport:
    """Everything ``lamina trace report`` prints."""

    directory: str
    totals: dict[str, Any]
    ops: list[OpRow]
    overlap: list[StepOverlap]
    steps: list[StepSummary]
    stragglers: StragglerReport
    #: A pipelined run's schedule, compute, bubble and sync per rank and step
    #: (:mod:`lamina.trace.pipeline_view`; empty for other runs).
    pipeline: list[PipelineStep] = field(default_factory=list)
    #: An expert-parallel run's load per step, MoE layer and rank
    #: (:mod:`lamina.trace.expert_view`; empty for other runs).
    experts: list[ExpertLoad] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (what ``--json`` prints)."""
        return {
            "directory": self.directory,
            "totals": self.totals,
            "ops": [r.to_json() for r in self.ops],
            "steps": [s.to_json() for s in self.steps],
            "overlap": [r.to_json() for r in self.overlap],
            "stragglers": self.stragglers.to_json(),
            "pipeline": [r.to_json() for r in self.pipeline],
            "experts": [r.to_json() for r in self.experts],
        }


def build_report(traces: dict[int, RankTrace], directory: str = "") -> TraceReport:
    """The report of traces already read (see :func:`report`)."""
    calls: dict[tuple[tuple[int, ...], int], int] = {}
    for trace in traces.values():
        for event in trace.collectives:
            calls.setdefault((event.group, event.seq), event.bytes)
    events = [e for t in traces.values() for e in t.collectives]
    steps = {e.step for e in events} | {s.step for t in traces.values() for s in t.spans}
    world = max((int(t.meta.get("world_size", 0)) for t in traces.values()), default=0)
    totals = {
        "ranks": len(traces),
        "rank_ids": sorted(traces),
        "world_size": world,
        "steps": len(steps),
        "collectives": len(calls),
        "events": len(events),
        "bytes": sum(calls.values()),
        "pending": sum(1 for e in events if e.end_ns is None),
        "dropped": sum(int(t.meta.get("dropped", 0)) for t in traces.values()),
    }
    overlap = overlap_by_step(traces)
    return TraceReport(
        directory,
        totals,
        op_table(traces),
        overlap,
        summarize_steps(overlap),
        stragglers(traces),
        pipeline_by_step(traces),
        expert_load(traces),
    )


def report(directory: str | Path) -> TraceReport:
    """Read every rank's trace in ``directory`` and analyse it (ConfigError when unreadable)."""
    return build_report(read_dir(directory), str(directory))
