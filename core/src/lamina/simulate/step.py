"""A whole training step priced from its execution plan's nodes: :func:`price_step`.

The plan says what runs and in which order; :class:`NodePrices` says what each node
costs (a compute node's seconds, a collective's on its group, a transfer's on its
link). The step is then simulated over the plan's own edges, per rank, on two
streams, as the engines run it:

- compute nodes (forward, backward, optimizer) run one at a time on the compute stream;
- gathers and the gradient collectives (a DP bucket's all-reduce, a ZeRO-3 unit's
  reduce-scatter, HSDP's replica all-reduce) run one at a time on the communication
  stream once their predecessors finished, beside the compute. A DP bucket whose
  predecessor is the whole model's backward is ready when backward has produced its
  gradients: after the share of the backward that the buckets before it and itself
  carry (the reducer fills them in order);
- the collectives inside a layer's forward or backward (tensor, context and expert
  parallelism's ``activation`` collectives, a broadcast inside the step), and the sends
  of a ring inside a layer (context parallelism passing keys and values to the next
  rank: every send that is not a pipeline's), block the compute that issues them: their
  seconds, each with the ranks' ``skew``, are added to their phase's compute nodes in
  proportion to those nodes' seconds;
- a pipelined plan's stages run the schedule :func:`~lamina.simulate.pipeline.
  schedule_pipeline` simulates over the pipeline's edges (each transfer its link's time
  plus the skew); the gathers of the stage's shards come before it, the gradient
  collectives and the optimizer after it.

What compute hides of the communication is ``overlap`` (from 0, none: compute and
communication one after the other, to 1, as much as the edges allow). Setup
collectives (the wrap-time broadcast) are not part of a step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

from lamina.runtime.nodes import Collective, Compute, Transfer
from lamina.runtime.plan import ExecutionPlan, PlanNode
from lamina.simulate.pipeline import PipelinePrediction, pipeline_axis, schedule_pipeline
from lamina.simulate.timing import modelled_op

#: Collective purposes that run on the communication stream beside the compute.
STREAMED_PURPOSES = ("gradient", "replicate", "unused")


class NodePrices(Protocol):
    """What one node of a plan costs (seconds)."""

    def compute(self, node: PlanNode) -> float:
        """A forward, backward or optimizer node."""
        ...

    def collective(self, node: PlanNode, op: str) -> float:
        """A collective or gather node, as ``op`` (:func:`modelled_op`) on its group."""
        ...

    def transfer(self, nbytes: int, axis: str) -> float:
        """One pipeline message of ``nbytes`` along ``axis``."""
        ...

    @property
    def overlap(self) -> float:
        """The share of the communication compute can hide (0 to 1)."""
        ...

    @property
    def skew(self) -> float:
        """Seconds a blocking collective or transfer waits for the last rank."""
        ...


@dataclass(frozen=True)
class PricedCollective:
    """One collective (or gather, or pipeline send) of the step as priced."""

    node: str
    op: str
    axis: str
    nbytes: int
    seconds: float
    #: Whether it blocks the compute (inside a layer, or a pipeline transfer).
    blocking: bool

    def to_json(self) -> dict[str, Any]:
        """Plain data."""
        return {
            "node": self.node,
            "op": self.op,
            "axis": self.axis,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "blocking": self.blocking,
        }


@dataclass(frozen=True)
class PricedStep:
    """A step's predicted seconds, its parts and every collective priced."""

    step_s: float
    parts: dict[str, float] = field(default_factory=dict)
    collectives: tuple[PricedCollective, ...] = ()
    pipeline: PipelinePrediction | None = None
    #: The step priced at the low and high end of the measured spread (None: not priced).
    interval_s: tuple[float, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds, bytes)."""
        return {
            "step_s": self.step_s,
            "interval_s": list(self.interval_s) if self.interval_s else None,
            "parts": dict(self.parts),
            "collectives": [c.to_json() for c in self.collectives],
            "pipeline": self.pipeline.to_json() if self.pipeline else None,
        }


def price_step(
    plan: ExecutionPlan, prices: NodePrices, pipeline: ExecutionPlan | None = None
) -> PricedStep:
    """``plan``'s step priced by ``prices`` (see the module). ``pipeline``: the plan of the
    pipeline a composed plan holds the stages of (default: ``plan`` itself when it has
    stage nodes)."""
    nodes = [n for n in plan.nodes if n.phase != "setup"]
    staged = pipeline if pipeline is not None else plan
    pipelined = any(is_stage(n) for n in staged.nodes)
    between_stages = pipeline_axis(staged) if pipelined else None
    priced: list[PricedCollective] = []
    blocking: dict[str, float] = defaultdict(float)
    streamed: dict[str, float] = {}
    for node in nodes:
        detail = node.detail
        if node.kind == "send" and isinstance(detail, Transfer):
            if detail.axis == between_stages:
                continue  # the schedule's (:func:`_pipelined`)
            seconds = prices.transfer(detail.nbytes, detail.axis) + prices.skew
            blocking[node.phase] += seconds
            priced.append(
                PricedCollective(node.id, "send", detail.axis, detail.nbytes, seconds, True)
            )
            continue
        if node.collective is None:
            continue
        op = modelled_op(node)
        seconds = prices.collective(node, op)
        inside = _blocks_compute(node)
        if inside:
            seconds += prices.skew
            blocking[node.phase] += seconds
        else:
            streamed[node.id] = seconds
        priced.append(
            PricedCollective(
                node.id, op, node.collective.axis, node.collective.nbytes, seconds, inside
            )
        )
    found = _Priced(priced, streamed, blocking)
    if pipelined:
        return _pipelined(staged, nodes, prices, found)
    return _scheduled(plan, nodes, prices, found)


def _blocks_compute(node: PlanNode) -> bool:
    """Whether the collective runs inside a layer (the compute waits for it)."""
    facts = node.facts(Collective)
    if node.kind == "gather" or facts is None:
        return False
    return facts.purpose not in STREAMED_PURPOSES


def is_stage(node: PlanNode) -> bool:
    """Whether ``node`` is a pipeline stage's compute (a stage run by a pipeline rank)."""
    detail = node.detail
    return isinstance(detail, Compute) and detail.rank is not None and detail.stage is not None


@dataclass(frozen=True)
class _Priced:
    """The step's collectives as priced: every one, those on the communication stream
    (seconds by node) and those holding the compute up (seconds by phase)."""

    every: list[PricedCollective]
    streamed: dict[str, float]
    blocking: dict[str, float]


def _scheduled(
    plan: ExecutionPlan, nodes: list[PlanNode], prices: NodePrices, found: _Priced
) -> PricedStep:
    """The step of a plan without a pipeline, simulated on its two streams."""
    priced, streamed, blocking = found.every, found.streamed, found.blocking
    ids = {n.id for n in nodes}
    by_id = {n.id: n for n in nodes}
    preds: dict[str, list[str]] = defaultdict(list)
    for before, after in plan.edges:
        if before in ids and after in ids:
            preds[after].append(before)
    own = {n.id: prices.compute(n) for n in nodes if n.collective is None and _computes(n)}
    phase_total: dict[str, float] = defaultdict(float)
    for node_id, seconds in own.items():
        phase_total[by_id[node_id].phase] += seconds
    duration: dict[str, float] = {}
    for node_id, seconds in own.items():
        phase = by_id[node_id].phase
        extra = blocking.get(phase, 0.0)
        share = seconds / phase_total[phase] if phase_total[phase] else 0.0
        duration[node_id] = seconds + extra * share
    for node_id in streamed:
        duration[node_id] = streamed[node_id]
    ready_share = _bucket_shares(nodes)
    order = {node_id: k for k, node_id in enumerate(plan.topological_order())}
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    free = {"compute": 0.0, "comm": 0.0}
    waiting = {n.id for n in nodes}
    while waiting:
        best: tuple[float, int, str] | None = None
        for node_id in waiting:
            if not all(p in finish for p in preds[node_id]):
                continue
            ready = _ready(node_id, preds[node_id], start, finish, duration, ready_share)
            stream = _stream(by_id[node_id], node_id in streamed)
            at = max(ready, free[stream]) if stream else ready
            key = (at, order.get(node_id, 0), node_id)
            if best is None or key < best:
                best = key
        assert best is not None, "a plan's edges form a DAG (checked when it is built)"
        at, _, node_id = best
        waiting.discard(node_id)
        start[node_id] = at
        finish[node_id] = at + duration.get(node_id, 0.0)
        stream = _stream(by_id[node_id], node_id in streamed)
        if stream:
            free[stream] = finish[node_id]
    # a blocking collective of a phase with no compute node of its own waits alone
    alone = sum(s for phase, s in blocking.items() if not phase_total.get(phase))
    overlapped = max(finish.values(), default=0.0) + alone
    compute = sum(own.values())
    held_up = sum(blocking.values())
    communication = sum(streamed.values())
    serial = compute + held_up + communication
    step = prices.overlap * overlapped + (1.0 - prices.overlap) * serial
    optimizer = sum(s for i, s in own.items() if by_id[i].kind == "optimizer")
    return PricedStep(
        step,
        {
            "compute": compute - optimizer,
            "blocking collectives": held_up,
            "communication": communication,
            "exposed": max(0.0, step - compute - held_up),
            "optimizer": optimizer,
        },
        tuple(priced),
    )


def _computes(node: PlanNode) -> bool:
    return node.kind in ("forward", "backward", "optimizer")


def _stream(node: PlanNode, is_streamed: bool) -> str:
    if is_streamed:
        return "comm"
    return "compute" if _computes(node) else ""


def _bucket_shares(nodes: list[PlanNode]) -> dict[str, float]:
    """Each DP bucket's all-reduce: the share of the whole backward done when its
    gradients are all there (the buckets before it and its own bytes over all of them)."""
    buckets = []
    for node in nodes:
        facts = node.facts(Collective)
        if facts is not None and facts.bucket is not None and node.collective is not None:
            buckets.append((facts.bucket, node.id, node.collective.numel))
    total = sum(numel for _, _, numel in buckets)
    shares: dict[str, float] = {}
    done = 0
    for _, node_id, numel in sorted(buckets):
        done += numel
        shares[node_id] = done / total if total else 1.0
    return shares


def _ready(
    node_id: str,
    before: list[str],
    start: dict[str, float],
    finish: dict[str, float],
    duration: dict[str, float],
    ready_share: dict[str, float],
) -> float:
    """When ``node_id`` may start: its predecessors done; a bucket, when the backward it
    follows has produced its share."""
    share = ready_share.get(node_id)
    times = []
    for p in before:
        if share is not None and p in start and p in duration:
            times.append(start[p] + duration[p] * share)
        else:
            times.append(finish[p])
    return max(times, default=0.0)


def _pipelined(
    staged: ExecutionPlan, nodes: list[PlanNode], prices: NodePrices, found: _Priced
) -> PricedStep:
    """A pipelined step: its stages' gathers, the schedule, then the gradient collectives
    and the optimizer, one after the other."""
    priced, streamed, blocking = found.every, found.streamed, found.blocking
    axis = pipeline_axis(staged)

    def link_s(nbytes: int) -> float:
        return prices.transfer(nbytes, axis) + prices.skew

    def stage_s(node: PlanNode) -> float:
        return prices.compute(node)

    schedule = schedule_pipeline(staged, link_s, stage_s)
    assert schedule is not None
    for node in staged.nodes:
        detail = node.detail
        if node.kind == "send" and isinstance(detail, Transfer) and detail.axis == axis:
            priced.append(
                PricedCollective(node.id, "send", axis, detail.nbytes, link_s(detail.nbytes), True)
            )
    kinds = {n.id: n.kind for n in nodes}
    gathers = sum(s for i, s in streamed.items() if kinds[i] == "gather")
    after = sum(streamed.values()) - gathers + sum(blocking.values())
    optimizer = sum(prices.compute(n) for n in nodes if n.kind == "optimizer")
    step = gathers + schedule.schedule_s + after + optimizer
    busy = max(schedule.compute_s, default=0.0)
    return PricedStep(
        step,
        {
            "compute": busy,
            "bubble": schedule.schedule_s - busy,
            "communication": gathers + after,
            "exposed": gathers + after,
            "optimizer": optimizer,
        },
        tuple(priced),
        schedule,
    )


__all__ = [
    "STREAMED_PURPOSES",
    "NodePrices",
    "PricedCollective",
    "PricedStep",
    "is_stage",
    "price_step",
]
