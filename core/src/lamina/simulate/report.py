"""A step's prediction as a result: its totals, the text report, the JSON, the assumptions.

Tensor parallelism's activation collectives are per-step collectives like the others
(in the table and the totals) and are also listed per layer (:meth:`StepPrediction.by_layer`).

:class:`StepPrediction` holds every collective's time (:mod:`lamina.simulate.timing`) and
the per-rank memory (:mod:`lamina.simulate.memory`); :func:`assumptions` lists what the
prediction assumes, as the report prints it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lamina.runtime.nodes import Collective
from lamina.runtime.plan import ExecutionPlan
from lamina.simulate.cluster import Cluster
from lamina.simulate.context import ContextPrediction
from lamina.simulate.expert import ExpertPrediction
from lamina.simulate.groups import LINKS, Groups
from lamina.simulate.memory import MemoryEstimate
from lamina.simulate.pipeline import PipelinePrediction
from lamina.simulate.timing import CollectiveTime
from lamina.units import format_bytes

#: Rows of the per-collective table the text report prints before eliding.
MAX_ROWS = 24
#: The purpose of tensor parallelism's collectives on activations.
ACTIVATION = "activation"
#: How the report names the root module (whose name is "").
ROOT = "(root)"


@dataclass(frozen=True)
class StepPrediction:
    """Communication time and memory of one step of a plan on a cluster."""

    cluster: Cluster
    strategy: str
    captured_world_size: int
    per_step: tuple[CollectiveTime, ...]
    once: tuple[CollectiveTime, ...]
    memory: MemoryEstimate
    assumptions: tuple[str, ...]
    groups: tuple[str, ...] = field(default=())
    #: A pipelined plan's simulated schedule (None for other plans).
    pipeline: PipelinePrediction | None = None
    #: A context-parallel plan's compute and ring (None for other plans).
    context: ContextPrediction | None = None
    #: An expert-parallel plan's measured compute (None for other plans).
    expert: ExpertPrediction | None = None

    @property
    def step_s(self) -> float:
        """Seconds of one step as predicted: a pipeline's schedule (compute, transfers,
        bubble) then the per-step collectives; a context-parallel step's measured compute
        and its ring's exposed transfers, then the collectives; for other plans the
        collectives alone (their compute is not modelled); an expert-parallel step's
        measured compute, then its collectives."""
        context = self.context.compute_s + self.context.ring_exposed_s if self.context else 0.0
        expert = self.expert.compute_s if self.expert else 0.0
        return (
            (self.pipeline.schedule_s if self.pipeline else 0.0) + context + expert + self.total_s
        )

    @property
    def total_s(self) -> float:
        """Seconds of communication per step (collectives one after the other)."""
        return sum(c.seconds for c in self.per_step)

    def link_s(self, link: str) -> float:
        """The part of :attr:`total_s` bound by ``link``."""
        return sum(c.link_seconds(link) for c in self.per_step)

    @property
    def step_bytes(self) -> int:
        """Bytes of the per-step collectives (each counted once, as the buffer size)."""
        return sum(c.nbytes for c in self.per_step)

    @property
    def activations(self) -> tuple[CollectiveTime, ...]:
        """Tensor parallelism's activation collectives of the step (part of
        :attr:`per_step`)."""
        return tuple(c for c in self.per_step if c.purpose == ACTIVATION)

    def by_layer(self) -> list[LayerRow]:
        """The activation collectives summed per (layer, op), in plan order (the root
        module as ``(root)``)."""
        table: dict[tuple[str, str], LayerRow] = {}
        for c in self.activations:
            layer = c.layer or ROOT
            row = table.get((layer, c.op))
            links = _links(c)
            if row is None:
                table[(layer, c.op)] = LayerRow(
                    layer, c.op, 1, c.nbytes, c.seconds, links, c.group_size, c.axis
                )
            else:
                table[(layer, c.op)] = LayerRow(
                    layer,
                    c.op,
                    row.count + 1,
                    row.nbytes + c.nbytes,
                    row.seconds + c.seconds,
                    row.link if row.link == links else "intra+inter",
                    row.group_size,
                    row.axis,
                )
        return list(table.values())

    def by_kind(self) -> list[tuple[str, str, str, int, float]]:
        """(op, phase name, link, collectives, seconds) summed over the step."""
        table: dict[tuple[str, str, str], tuple[int, float]] = {}
        for c in self.per_step:
            for p in c.phases:
                count, seconds = table.get((c.op, p.name, p.link), (0, 0.0))
                table[(c.op, p.name, p.link)] = (count + 1, seconds + p.seconds)
        return [(op, name, link, n, s) for (op, name, link), (n, s) in table.items()]

    def report(self) -> str:
        """The readable report ``lamina plan --simulate`` prints."""
        lines = [
            f"cluster: {self.cluster.describe()}",
            f"plan: {self.strategy}, captured on {self.captured_world_size} local rank(s); "
            f"simulated on {self.cluster.world_size} rank(s)",
            *(f"group: {g}" for g in self.groups),
            "",
            f"collectives per step ({len(self.per_step)}):",
        ]
        lines += _collective_table(self.per_step)
        if self.activations:
            lines += ["", *self._layer_table()]
        lines += ["", "per step by kind, phase and link class:"]
        lines.append(f"  {'op':<15}{'phase':<22}{'link':<7}{'count':>6}{'ms':>12}")
        for op, name, link, count, seconds in self.by_kind():
            lines.append(f"  {op:<15}{name:<22}{link:<7}{count:>6}{_ms(seconds):>12}")
        lines += [
            "",
            f"per step: {_ms(self.total_s)} ms of communication (intra {_ms(self.link_s('intra'))}"
            f" ms, inter {_ms(self.link_s('inter'))} ms), {len(self.per_step)} collective(s), "
            f"{format_bytes(self.step_bytes)}"
            + (
                f"; tensor-parallel activations {_ms(self.activation_s)} ms of it "
                f"({len(self.activations)} collective(s), "
                f"{format_bytes(sum(c.nbytes for c in self.activations))})"
                if self.activations
                else ""
            ),
        ]
        if self.pipeline is not None:
            lines += [
                "",
                *self.pipeline.lines(),
                f"step: {_ms(self.step_s)} ms (the schedule, then {_ms(self.total_s)} ms of "
                "gradient collectives)",
            ]
        if self.context is not None:
            lines += [
                "",
                *self.context.lines(),
                f"step: {_ms(self.step_s)} ms (compute and exposed ring, then "
                f"{_ms(self.total_s)} ms of collectives)",
            ]
        if self.expert is not None:
            lines += [
                "",
                *self.expert.lines(),
                f"step: {_ms(self.step_s)} ms (compute, then {_ms(self.total_s)} ms of "
                "collectives)",
            ]
        if self.once:
            total = sum(c.seconds for c in self.once)
            lines.append(
                f"once at wrap time: {_ms(total)} ms ("
                + ", ".join(
                    f"{c.node} {c.op} {format_bytes(c.nbytes)} {_ms(c.seconds)} ms"
                    for c in self.once
                )
                + ")"
            )
        memory = self.memory
        kind = (
            "replicated"
            if memory.shard_group == 1
            else f"split over {memory.split_axis}={memory.shard_group:,}"
            if memory.split_axis
            else f"sharded over {memory.shard_group:,}"
        )
        lines += ["", f"memory per rank ({self.strategy}, {kind}; activations not counted):"]
        width = max(len(format_bytes(b)) for _, b, _ in memory.rows())
        for what, nbytes, formula in memory.rows():
            lines.append(f"  {what:<17}{format_bytes(nbytes):>{width}}  {formula}")
        if memory.device_memory_bytes:
            used = memory.peak / memory.device_memory_bytes
            verdict = "fits" if used <= 1 else "DOES NOT FIT"
            lines.append(
                f"  device memory {format_bytes(memory.device_memory_bytes)}: {used:.2%} used by "
                f"model state at peak ({verdict}; activations come on top)"
            )
        lines += ["", "assumptions:", *(f"  - {a}" for a in self.assumptions)]
        return "\n".join(lines)

    @property
    def activation_s(self) -> float:
        """The part of :attr:`total_s` spent in tensor-parallel activation collectives."""
        return sum(c.seconds for c in self.activations)

    def _layer_table(self) -> list[str]:
        rows = self.by_layer()
        first = self.activations[0]
        group = f"{first.axis} group of {first.group_size:,} rank(s)"
        out = [
            f"tensor-parallel activation collectives per layer ({len(self.activations)} on the "
            f"{group}; bytes per microbatch from the captured forward):"
        ]
        width = max([24, *(len(r.layer) for r in rows)]) + 2
        out.append(
            f"  {'layer':<{width}}{'op':<15}{'count':>6}{'bytes':>11}  {'link':<12}{'ms':>10}"
        )
        for r in rows:
            out.append(
                f"  {r.layer:<{width}}{r.op:<15}{r.count:>6}{format_bytes(r.nbytes):>11}  "
                f"{r.link:<12}{_ms(r.seconds):>10}"
            )
        total = sum(r.nbytes for r in rows)
        out.append(
            f"  {'total':<{width}}{'':<15}{len(self.activations):>6}{format_bytes(total):>11}  "
            f"{'':<12}{_ms(self.activation_s):>10}"
        )
        return out

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds, bytes)."""
        return {
            "cluster": self.cluster.to_json(),
            "strategy": self.strategy,
            "captured_world_size": self.captured_world_size,
            "simulated_world_size": self.cluster.world_size,
            "groups": list(self.groups),
            "per_step": {
                "seconds": self.total_s,
                "intra_s": self.link_s("intra"),
                "inter_s": self.link_s("inter"),
                "bytes": self.step_bytes,
                "collectives": len(self.per_step),
                "by_kind": [
                    {"op": op, "phase": name, "link": link, "count": n, "seconds": s}
                    for op, name, link, n, s in self.by_kind()
                ],
            },
            "activations": {
                "seconds": self.activation_s,
                "bytes": sum(c.nbytes for c in self.activations),
                "collectives": len(self.activations),
                "by_layer": [r.to_json() for r in self.by_layer()],
            },
            "collectives": [c.to_json() for c in self.per_step],
            "once": [c.to_json() for c in self.once],
            "pipeline": self.pipeline.to_json() if self.pipeline else None,
            "context": self.context.to_json() if self.context else None,
            "expert": self.expert.to_json() if self.expert else None,
            "step_s": self.step_s,
            "memory": self.memory.to_json(),
            "assumptions": list(self.assumptions),
        }


def assumptions(
    plan: ExecutionPlan, cluster: Cluster, k: float, groups: Groups | None = None
) -> tuple[str, ...]:
    """The assumptions behind a prediction, as the report lists them."""
    out = [
        "per-step time = every per-step collective one after the other: no overlap with "
        "compute (DP buckets and ZeRO-3 prefetch hide part of it on a real job) nor between "
        "collectives",
        f"alpha-beta links: intra {cluster.intra.describe()}; inter: a host's "
        f"{cluster.nics_per_host} NIC(s) form a {cluster.uplink_gbps:g} GB/s uplink that the "
        "flows leaving the host share; the network core never congests (full bisection)",
        "ranks placed host by host; an all-reduce runs the algorithm the cost model picks "
        "(algorithm='auto' on an NCCL-like backend); no tree algorithms",
        "gathers and reduce-scatters: rings over the group in topology order (P-1 steps of "
        "n/P), whatever primitive the capture's backend used",
        f"buckets and units are the capture's ({plan.world_size} local rank(s)): their "
        "boundaries do not depend on the world size, only the byte totals are applied to the "
        f"simulated {cluster.world_size} ranks (shard sizes recomputed, padding the capture's)",
        *(
            [
                "HSDP replica all-reduces: one per unit after its reduce-scatter, of the shard "
                "the simulated shard group holds (derived from the unit, not the capture)"
            ]
            if plan.replicate_axis
            else []
        ),
        *_tp_assumptions(plan, cluster, groups),
        f"memory: model state only, K = {k:g} B of optimizer state per parameter (AdamW: two "
        "fp32 moments); activations, workspace and allocator slack not counted",
    ]
    return tuple(out)


def _tp_assumptions(plan: ExecutionPlan, cluster: Cluster, groups: Groups | None) -> list[str]:
    """What a prediction with tensor-parallel activation collectives assumes."""
    specs = [
        n.collective
        for n in plan.collectives()
        if n.collective is not None
        and (facts := n.facts(Collective)) is not None
        and facts.purpose == ACTIVATION
    ]
    if not specs:
        return []
    axis, captured = specs[0].axis, len(specs[0].group)
    out = [
        "tensor-parallel activation collectives: one per layer collective of the captured "
        "step, each the full activation (or its gradient) of the capture's microbatch, not "
        "scaled by the simulated data-parallel world"
    ]
    if groups is not None:
        group = groups.of(axis)
        where = (
            f"it CROSSES HOSTS ({group.model.layout.host_count} hosts of "
            f"{cluster.devices_per_host}): its rings run over the inter-host link"
            if group.crosses_hosts
            else "inside one host: the intra-host link"
        )
        whose = "the simulated mesh's" if cluster.mesh else "the whole cluster (no mesh)"
        out.append(
            f"the {axis} group is {whose} ({axis}={group.size}, the capture's had "
            f"{captured}), {where}"
        )
        if "+" in plan.strategy and group.size != captured:
            out.append(
                f"the other strategies' buckets and units hold the capture's {axis}-local "
                f"tensors ({axis}={captured}): their bytes and the model state are not "
                f"rescaled to {axis}={group.size}"
            )
    return out


@dataclass(frozen=True)
class LayerRow:
    """The activation collectives of one (layer, op) summed over the step."""

    layer: str
    op: str
    count: int
    nbytes: int
    seconds: float
    #: The link classes that bound them: intra, inter or intra+inter.
    link: str
    group_size: int
    axis: str

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds, bytes)."""
        return {
            "layer": self.layer,
            "op": self.op,
            "count": self.count,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "link": self.link,
            "group_size": self.group_size,
            "axis": self.axis,
        }


def _links(c: CollectiveTime) -> str:
    used = [link for link in LINKS if any(p.link == link for p in c.phases)]
    return "+".join(used) or "none"


def _collective_table(rows: Iterable[CollectiveTime]) -> list[str]:
    rows = list(rows)
    width = max([26, *(len(c.node) for c in rows[:MAX_ROWS])]) + 2
    out = [
        f"  {'node':<{width}}{'op':<15}{'bytes':>10}  {'algorithm':<20}"
        f"{'intra ms':>10}{'inter ms':>10}{'total ms':>10}"
    ]
    for c in rows[:MAX_ROWS]:
        how = f"{c.algorithm} x{c.chunks}" if c.chunks > 1 else c.algorithm
        out.append(
            f"  {c.node:<{width}}{c.op:<15}{format_bytes(c.nbytes):>10}  {how:<20}"
            f"{_ms(c.link_seconds('intra')):>10}{_ms(c.link_seconds('inter')):>10}"
            f"{_ms(c.seconds):>10}"
        )
    if len(rows) > MAX_ROWS:
        out.append(f"  ... {len(rows) - MAX_ROWS} more (--json lists every one)")
    return out


def _ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:.3f}" if value < 1000 else f"{value:,.1f}"


__all__ = ["ACTIVATION", "MAX_ROWS", "LayerRow", "StepPrediction", "assumptions"]
