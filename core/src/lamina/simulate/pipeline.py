"""A pipelined plan's schedule on the simulated cluster (:func:`predict_pipeline`).

The plan's stage nodes carry the pipeline rank running them and their predicted seconds
(the cut's measured forward + backward of one microbatch), its send nodes the bytes
crossing each cut. The schedule is simulated over the plan's own dependencies: each
pipeline rank runs one stage node at a time, whichever can start first (a backward
before a forward when both can, then the lower microbatch, as 1F1B does once warmed up);
a send takes its bytes' time on the pipeline axis's link (the cost model's alpha-beta,
the pipelines' sends sharing a host's uplink) and its recv completes with it. The bubble
is each rank's time in the schedule spent not computing. The gradient collectives after
the schedule are priced as every other collective (:mod:`lamina.simulate.timing`).

The plan has one backward node per stage and microbatch; under the zero-bubble schedule
(ZBV) its first half is the input gradient, which the previous stage waits for, and its
second half the weight gradient, which nothing waits for: each rank runs those halves in
the gaps where it would otherwise wait, and what is left at the end of its schedule.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lamina.errors import ConfigError
from lamina.runtime.nodes import Compute, Transfer
from lamina.runtime.plan import ExecutionPlan, PlanNode
from lamina.runtime.render import CONTEXT_AXIS
from lamina.simulate.groups import Groups


@dataclass(frozen=True)
class PipelinePrediction:
    """The simulated schedule of one step (seconds)."""

    schedule: str
    microbatches: int
    #: Seconds from the first forward to the last backward.
    schedule_s: float
    #: Per pipeline rank: the seconds its stage nodes compute.
    compute_s: tuple[float, ...]
    #: The largest activation crossing a cut, per microbatch, and its time on the link.
    transfer_bytes: int
    transfer_s: float
    axis: str

    @property
    def bubbles(self) -> tuple[float, ...]:
        """Per pipeline rank: the fraction of the schedule it does not compute."""
        return tuple(1.0 - c / self.schedule_s if self.schedule_s else 0.0 for c in self.compute_s)

    @property
    def bubble(self) -> float:
        """The mean of :attr:`bubbles`."""
        return sum(self.bubbles) / len(self.bubbles) if self.bubbles else 0.0

    def lines(self) -> list[str]:
        """The report's lines."""
        ranks = ", ".join(
            f"rank {r}: {c * 1e3:.1f} ms ({b:.1%} idle)"
            for r, (c, b) in enumerate(zip(self.compute_s, self.bubbles, strict=True))
        )
        return [
            f"pipeline schedule ({self.schedule}, {self.microbatches} microbatches, "
            f"{len(self.compute_s)} rank(s) on {self.axis}): {self.schedule_s * 1e3:.1f} ms, "
            f"bubble {self.bubble:.3f}",
            f"  compute per rank: {ranks}",
            f"  largest activation per microbatch {self.transfer_bytes:,} B: "
            f"{self.transfer_s * 1e3:.2f} ms on the link",
        ]

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds, bytes)."""
        return {
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "schedule_s": self.schedule_s,
            "compute_s": list(self.compute_s),
            "bubbles": list(self.bubbles),
            "bubble": self.bubble,
            "transfer_bytes": self.transfer_bytes,
            "transfer_s": self.transfer_s,
            "axis": self.axis,
        }


def predict_pipeline(plan: ExecutionPlan, groups: Groups) -> PipelinePrediction | None:
    """The simulated schedule of ``plan`` on the declared cluster's links (see the
    module); None for a plan without pipeline stages."""
    if not any(_stage_compute(n) is not None for n in plan.nodes):
        return None
    return schedule_pipeline(plan, _link_seconds(groups, pipeline_axis(plan)))


def schedule_pipeline(
    plan: ExecutionPlan,
    link_s: Callable[[int], float],
    stage_s: Callable[[PlanNode], float] | None = None,
) -> PipelinePrediction | None:
    """The simulated schedule of ``plan`` (see the module), each transfer of ``n`` bytes
    taking ``link_s(n)`` and each stage node ``stage_s(node)`` (default: the seconds the
    plan predicts for it); None for a plan without pipeline stages."""
    stages = {n.id: n for n in plan.nodes if _stage_compute(n) is not None}
    if not stages:
        return None
    axis = pipeline_axis(plan)
    # the pipeline's own transfers (a context-parallel ring's go along its own axis)
    sends = {
        n.id: n for n in plan.nodes if isinstance(n.detail, Transfer) and n.detail.axis == axis
    }
    preds: dict[str, list[str]] = defaultdict(list)
    for before, after in plan.edges:
        if before in stages or before in sends:
            preds[after].append(before)
    finish: dict[str, float] = {}
    free: dict[int, float] = defaultdict(float)
    busy: dict[int, float] = defaultdict(float)
    schedule = dict(plan.meta).get("schedule", "")
    # zero bubble: a backward's weight-gradient half waits for nothing downstream, so
    # each rank runs it in the gaps it would otherwise idle in (and any left at the end)
    deferred: dict[int, float] = defaultdict(float) if schedule in WEIGHT_SPLIT else {}
    waiting = dict(stages)
    while waiting:
        _settle_transfers(sends, preds, finish, link_s)
        best: tuple[tuple[float, int, int, int], str] | None = None
        for node_id, node in waiting.items():
            if not all(p in finish for p in preds[node_id]):
                continue
            detail = _stage_compute(node)
            assert detail is not None and detail.rank is not None
            ready = max((finish[p] for p in preds[node_id]), default=0.0)
            start = max(ready, free[detail.rank])
            key = (start, node.kind != "backward", detail.microbatch or 0, detail.stage or 0)
            if best is None or key < best[0]:
                best = (key, node_id)
        if best is None:
            raise ConfigError(
                f"plan {plan.strategy}: the pipeline's nodes {sorted(waiting)[:3]} wait on "
                "each other; the plan's edges do not form a schedule (fix the strategy)"
            )
        (start, *_), node_id = best
        node = waiting.pop(node_id)
        detail = _stage_compute(node)
        assert detail is not None and detail.rank is not None and detail.seconds is not None
        rank = detail.rank
        seconds = stage_s(node) if stage_s is not None else detail.seconds
        if schedule in WEIGHT_SPLIT:
            filled = min(deferred[rank], start - free[rank])
            deferred[rank] -= filled
            busy[rank] += filled
            if node.kind == "backward":  # its input-gradient half now, weights later
                seconds /= 2
                deferred[rank] += seconds
        finish[node_id] = start + seconds
        free[rank] = finish[node_id]
        busy[rank] += seconds
    ends = [free[r] + deferred.get(r, 0.0) for r in free]
    for rank, left in deferred.items():
        busy[rank] += left
    largest = max(
        (t.detail.nbytes for t in sends.values() if isinstance(t.detail, Transfer)), default=0
    )
    return PipelinePrediction(
        schedule=schedule,
        microbatches=len({d.microbatch for n in stages.values() if (d := _stage_compute(n))}),
        schedule_s=max([*finish.values(), *ends], default=0.0),
        compute_s=tuple(busy[r] for r in sorted(busy)),
        transfer_bytes=largest,
        transfer_s=link_s(largest) if largest else 0.0,
        axis=axis,
    )


#: Schedules that split each backward into its input gradient, sent on at once, and its
#: weight gradient, run when the rank would idle.
WEIGHT_SPLIT = ("zbv",)


def pipeline_axis(plan: ExecutionPlan) -> str:
    """The mesh axis a pipelined plan's transfers run along (``pp`` when it has none; a
    context-parallel ring's axis, named in the plan's meta, is not it)."""
    ring = dict(plan.meta).get(CONTEXT_AXIS)
    return next(
        (
            n.detail.axis
            for n in plan.nodes
            if isinstance(n.detail, Transfer) and n.detail.axis != ring
        ),
        "pp",
    )


def _stage_compute(node: PlanNode) -> Compute | None:
    detail = node.detail
    if isinstance(detail, Compute) and detail.seconds is not None and detail.rank is not None:
        return detail
    return None


def _link_seconds(groups: Groups, axis: str) -> Callable[[int], float]:
    """Seconds of one message of ``n`` bytes between neighbouring pipeline ranks."""
    group = groups.of(axis)
    link = group.model.inter if group.crosses_hosts else group.model.intra
    return lambda nbytes: link.time(nbytes) if group.size > 1 else 0.0


def _settle_transfers(
    sends: dict[str, PlanNode],
    preds: dict[str, list[str]],
    finish: dict[str, float],
    link_s: Callable[[int], float],
) -> None:
    """Finish every send and recv whose predecessors have finished: a send its bytes'
    time after them, a recv with its send."""
    moved = True
    while moved:
        moved = False
        for node_id, node in sends.items():
            if node_id in finish or not all(p in finish for p in preds[node_id]):
                continue
            ready = max((finish[p] for p in preds[node_id]), default=0.0)
            assert isinstance(node.detail, Transfer)
            finish[node_id] = ready + (link_s(node.detail.nbytes) if node.kind == "send" else 0)
            moved = True
