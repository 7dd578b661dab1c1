"""The pipeline's view of a trace: per rank and step, how long the schedule ran, how much
of it this rank's stages computed (the rest is the bubble: waiting on a neighbour's
activation or gradient, and the transfers themselves), and the gradient sync after it.

Reads the ``pipeline`` spans a pipelined step records (``schedule``, ``gradient sync``)
and the ``compute`` spans of its stages' chunks (:mod:`lamina.strategies.pp.engine`).
Pure functions over :class:`~lamina.trace.events.RankTrace` data (no torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lamina.trace.events import RankTrace
from lamina.trace.intervals import union

#: The track of a pipelined step's phases, and the names of its spans.
PIPELINE_TRACK = "pipeline"
SCHEDULE = "schedule"
GRADIENT_SYNC = "gradient sync"


@dataclass
class PipelineStep:
    """One rank's pipelined step (ns)."""

    rank: int
    step: int
    schedule_ns: int
    compute_ns: int
    sync_ns: int

    @property
    def bubble(self) -> float:
        """The fraction of the schedule this rank did not compute."""
        return 1.0 - self.compute_ns / self.schedule_ns if self.schedule_ns else 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready row with ``bubble``."""
        return {**asdict(self), "bubble": self.bubble}


def pipeline_by_step(traces: dict[int, RankTrace]) -> list[PipelineStep]:
    """Every rank's pipelined steps, by rank then step (empty for a trace without them)."""
    rows = []
    for rank, trace in sorted(traces.items()):
        closed = [(s, s.end_ns) for s in trace.spans if s.end_ns is not None]
        computed = [(s.start_ns, end) for s, end in closed if s.track == "compute"]
        for span, end in closed:
            if (span.track, span.name) != (PIPELINE_TRACK, SCHEDULE):
                continue
            start = span.start_ns
            inside = union((max(a, start), min(b, end)) for a, b in computed)  # clipped
            sync = sum(
                stop - s.start_ns
                for s, stop in closed
                if (s.track, s.name, s.step) == (PIPELINE_TRACK, GRADIENT_SYNC, span.step)
            )
            compute = sum(b - a for a, b in inside)
            rows.append(PipelineStep(rank, span.step, end - start, compute, sync))
    return rows
