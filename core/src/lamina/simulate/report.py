"""A step's prediction as a result: its totals, the text report, the JSON, the assumptions.

:class:`StepPrediction` holds every collective's time (:mod:`lamina.simulate.timing`) and
the per-rank memory (:mod:`lamina.simulate.memory`); :func:`assumptions` lists what the
prediction assumes, as the report prints it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lamina.runtime.plan import ExecutionPlan
from lamina.simulate.cluster import Cluster
from lamina.simulate.memory import MemoryEstimate
from lamina.simulate.timing import CollectiveTime
from lamina.units import format_bytes

#: Rows of the per-collective table the text report prints before eliding.
MAX_ROWS = 24


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
        lines += ["", "per step by kind, phase and link class:"]
        lines.append(f"  {'op':<15}{'phase':<22}{'link':<7}{'count':>6}{'ms':>12}")
        for op, name, link, count, seconds in self.by_kind():
            lines.append(f"  {op:<15}{name:<22}{link:<7}{count:>6}{_ms(seconds):>12}")
        lines += [
            "",
            f"per step: {_ms(self.total_s)} ms of communication (intra {_ms(self.link_s('intra'))}"
            f" ms, inter {_ms(self.link_s('inter'))} ms), {len(self.per_step)} collective(s), "
            f"{format_bytes(self.step_bytes)}",
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
        kind = "replicated" if memory.shard_group == 1 else f"sharded over {memory.shard_group:,}"
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
            "collectives": [c.to_json() for c in self.per_step],
            "once": [c.to_json() for c in self.once],
            "memory": self.memory.to_json(),
            "assumptions": list(self.assumptions),
        }


def assumptions(plan: ExecutionPlan, cluster: Cluster, k: float) -> tuple[str, ...]:
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
        f"memory: model state only, K = {k:g} B of optimizer state per parameter (AdamW: two "
        "fp32 moments); activations, workspace and allocator slack not counted",
    ]
    return tuple(out)


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


__all__ = ["MAX_ROWS", "StepPrediction", "assumptions"]
