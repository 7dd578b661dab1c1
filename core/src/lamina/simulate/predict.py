"""Predict a training step's communication time and per-rank memory on a declared cluster.

Input: an :class:`~lamina.runtime.ExecutionPlan` captured on a few local ranks (its
collective nodes: op, bytes, group axis; the strategy) and a
:class:`~lamina.simulate.cluster.Cluster`. Output: a :class:`StepPrediction` with every
collective's time split by phase and link class, the per-step totals, and the model
state each rank holds.

Time (the alpha-beta model of :mod:`lamina.comm.cost`; ``alpha`` the latency of one
message, ``beta`` seconds per byte; a group of ``P = H x L`` ranks, ``H`` hosts of ``L``):

- **all-reduce** (DP gradient buckets, HSDP replica all-reduces, buffers are broadcasts):
  the algorithm :meth:`CostModel.choose <lamina.comm.cost.CostModel.choose>` picks, as
  ``algorithm="auto"`` does on the real job; ``flat`` / ``ordered`` are rings of
  ``2(P-1)`` steps of ``n/P`` bytes, each step as slow as its slowest edge (an inter
  edge shares its host's uplink with the other edges leaving the host); the halves are
  reported as the reduce-scatter and the all-gather, on the bottleneck's link class.
  ``hierarchical``: intra reduce-scatter ``(L-1)(alpha + n/L beta_intra)``, inter
  all-reduce ``2(H-1)(alpha + n/(LH) L beta_up)`` (``L`` flows share the uplink), intra
  all-gather as the reduce-scatter. ``pipelined`` on ``k`` chunks: one chunk's three
  phases, then ``k-1`` times the slower of (inter phase, intra phases), counted on the
  slower one's link class.
- **all-gather / reduce-scatter** (ZeRO-3 and HSDP unit gathers and gradient
  reduce-scatters): a ring over the group in topology order, ``P-1`` steps of ``n/P``
  bytes (``n`` the full unit), each step ``max(alpha_intra + n/P beta_intra,
  alpha_inter + n/P c beta_up)`` with ``c`` the ring edges leaving one host (1 when the
  ranks are placed host by host): ``(P-1)`` alphas, and ``(P-1)/P n`` bytes through the
  bottleneck link.
- **broadcast**: scatter then ring all-gather (van de Geijn): ``2(P-1)`` steps of
  ``n/P``, costed like the ring all-reduce in topology order.
- **all-to-all**: pairwise exchange, ``L-1`` intra messages and ``P-L`` inter messages of
  ``n/P``, the ``L`` ranks of a host sharing its uplink.

The group of a collective is its mesh axis on the simulated cluster: ``intra`` is one
host's ``L`` ranks; ``inter`` is one rank per host (the ``L`` such groups run at once, so
each flow gets ``1/L`` of the uplink); any other axis (``world``, ``dp``, ``inter+intra``)
is the whole cluster.

The per-step total is the sum of the per-step collectives, one after the other: no
overlap with compute or between collectives (the real step hides part of it behind
backward; how much needs compute times, which this does not model). Collectives of the
``setup`` phase (the wrap-time broadcast) run once and are reported apart.

Memory per rank (model state: parameters, gradients, optimizer state; ``P``, ``G``
bytes per parameter and gradient element, ``K = 8`` for AdamW's two fp32 moments):

- replicated (DP): ``(P + G + K) x Psi`` with ``Psi`` the elements the gradient buckets
  carry (alignment padding included);
- sharded (ZeRO-3 / HSDP over a shard group of ``N`` ranks):
  ``(P + G + K) x S`` with ``S = sum over units of ceil(n_u / N)`` (about ``Psi / N``),
  plus the transient gathered units: those gathered for the whole forward (kept, with
  their full gradient, through backward) and the largest other unit with its full
  gradient before its reduce-scatter. Prefetching a second unit would add one more.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lamina.comm.cost import ALGORITHMS, unavailable_algorithms
from lamina.errors import ConfigError
from lamina.runtime.nodes import Collective, Gather
from lamina.runtime.plan import ExecutionPlan, PlanNode
from lamina.simulate.cluster import Cluster, ClusterCostModel
from lamina.units import format_bytes

#: Bytes of optimizer state per parameter element: AdamW's two fp32 moments.
ADAMW_BYTES_PER_PARAM = 8.0
#: Link classes, in report order.
LINKS: tuple[str, ...] = ("intra", "inter")
#: Rows of the per-collective table the text report prints before eliding.
MAX_ROWS = 24


@dataclass(frozen=True)
class PhaseTime:
    """One phase of a collective: its name, the link class that bounds it, its time."""

    name: str
    link: str
    seconds: float


@dataclass(frozen=True)
class CollectiveTime:
    """The predicted time of one collective node of the plan on the cluster."""

    node: str
    #: The operation as modelled (all_reduce, all_gather, reduce_scatter, broadcast, ...).
    op: str
    #: The step phase of the node (forward, backward, setup).
    step_phase: str
    nbytes: int
    group_size: int
    axis: str
    algorithm: str
    chunks: int
    phases: tuple[PhaseTime, ...]

    @property
    def seconds(self) -> float:
        """The whole collective."""
        return sum(p.seconds for p in self.phases)

    def link_seconds(self, link: str) -> float:
        """The part of it bound by ``link`` ("intra" or "inter")."""
        return sum(p.seconds for p in self.phases if p.link == link)

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds)."""
        return {
            "node": self.node,
            "op": self.op,
            "step_phase": self.step_phase,
            "bytes": self.nbytes,
            "group_size": self.group_size,
            "axis": self.axis,
            "algorithm": self.algorithm,
            "chunks": self.chunks,
            "seconds": self.seconds,
            "intra_s": self.link_seconds("intra"),
            "inter_s": self.link_seconds("inter"),
            "phases": [{"name": p.name, "link": p.link, "seconds": p.seconds} for p in self.phases],
        }


@dataclass(frozen=True)
class MemoryEstimate:
    """Model state per rank, by the ZeRO formulas (see the module docstring)."""

    strategy: str
    #: N: ranks the state is sharded over (1: replicated).
    shard_group: int
    #: Psi: parameter elements as the plan moves them (padding included).
    param_elements: int
    #: Elements each rank holds (Psi when replicated, sum of ceil(n_u / N) when sharded).
    local_elements: int
    param_bytes_per_element: float
    grad_bytes_per_element: float
    optimizer_bytes_per_element: float
    #: Transient gathered units (sharded only): parameters plus their full gradients.
    gathered_bytes: int = 0
    gathered_what: str = ""
    device_memory_bytes: int | None = None

    @property
    def parameters(self) -> int:
        """Bytes of parameters per rank."""
        return round(self.param_bytes_per_element * self.local_elements)

    @property
    def gradients(self) -> int:
        """Bytes of gradients per rank."""
        return round(self.grad_bytes_per_element * self.local_elements)

    @property
    def optimizer_state(self) -> int:
        """Bytes of optimizer state per rank."""
        return round(self.optimizer_bytes_per_element * self.local_elements)

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def peak(self) -> int:
        """State plus the transient gathered units."""
        return self.state + self.gathered_bytes

    def rows(self) -> list[tuple[str, int, str]]:
        """(what, bytes, formula) rows of the report."""
        p, g, k = (
            self.param_bytes_per_element,
            self.grad_bytes_per_element,
            self.optimizer_bytes_per_element,
        )
        n = self.shard_group
        count = (
            f"Psi = {self.param_elements:,}"
            if n == 1
            else f"S = sum ceil(n_u / {n:,}) = {self.local_elements:,} (Psi / N = "
            f"{self.param_elements / n:,.1f})"
        )
        elems = "Psi" if n == 1 else "S"
        rows = [
            ("parameters", self.parameters, f"P x {elems} = {p:g} B x {self.local_elements:,}"),
            ("gradients", self.gradients, f"G x {elems} = {g:g} B x {self.local_elements:,}"),
            (
                "optimizer state",
                self.optimizer_state,
                f"K x {elems} = {k:g} B x {self.local_elements:,} (AdamW: two fp32 moments)",
            ),
            ("model state", self.state, f"(P + G + K) x {elems}, {count}"),
        ]
        if n > 1:
            rows.append(("gathered units", self.gathered_bytes, self.gathered_what))
            rows.append(("peak", self.peak, "model state + gathered units"))
        return rows

    def to_json(self) -> dict[str, Any]:
        """Plain data (bytes)."""
        return {
            "strategy": self.strategy,
            "shard_group": self.shard_group,
            "param_elements": self.param_elements,
            "local_elements": self.local_elements,
            "bytes_per_element": {
                "parameters": self.param_bytes_per_element,
                "gradients": self.grad_bytes_per_element,
                "optimizer": self.optimizer_bytes_per_element,
            },
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "model_state": self.state,
            "gathered": self.gathered_bytes,
            "gathered_what": self.gathered_what,
            "peak": self.peak,
            "device_memory": self.device_memory_bytes,
        }


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


# -- the groups of the simulated cluster ------------------------------------------------


class _Group:
    """A simulated group (one mesh axis) with its cost model and cached ring figures."""

    def __init__(self, label: str, model: ClusterCostModel, whole_job: bool) -> None:
        self.label = label
        self.model = model
        self.size = model.layout.size
        unavailable = unavailable_algorithms(model.layout, "nccl", whole_job)
        self.allowed = tuple(a for a in ALGORITHMS if a not in unavailable)
        self._chosen: dict[int, tuple[str, int, tuple[PhaseTime, ...]]] = {}

    def _ring(self, topology_order: bool) -> tuple[bool, bool, int]:
        """(has intra edges, has inter edges, uplink sharing) of the ring."""
        layout = self.model.layout
        return self.model.ring_shape(layout.ring_order() if topology_order else layout.rank_order())

    def ring_step(self, nbytes: float, topology_order: bool = True) -> tuple[float, str]:
        """(seconds, bounding link class) of one ring step moving ``nbytes / P``."""
        has_intra, has_inter, share = self._ring(topology_order)
        chunk = nbytes / self.size
        intra = self.model.intra.time(chunk) if has_intra else 0.0
        inter = self.model.inter.time(chunk, share) if has_inter else 0.0
        return (inter, "inter") if has_inter and inter >= intra else (intra, "intra")

    def all_reduce(self, nbytes: int) -> tuple[str, int, tuple[PhaseTime, ...]]:
        """(algorithm, chunks, phases) of the model's pick for an all-reduce."""
        if self.size < 2:
            return "none", 1, ()
        if nbytes not in self._chosen:
            pick = self.model.choose(nbytes, self.allowed)
            phases: tuple[PhaseTime, ...]
            if pick.algorithm in ("flat", "ordered"):
                step, link = self.ring_step(nbytes, pick.algorithm == "ordered")
                half = (self.size - 1) * step
                phases = (
                    PhaseTime("reduce-scatter", link, half),
                    PhaseTime("all-gather", link, half),
                )
            else:
                chunks = pick.chunks if pick.algorithm == "pipelined" else 1
                rs, ar, ag = self.model.phases(nbytes / chunks)
                phases = (
                    PhaseTime("reduce-scatter", "intra", rs),
                    PhaseTime("all-reduce", "inter", ar),
                    PhaseTime("all-gather", "intra", ag),
                )
                if chunks > 1:
                    link = "inter" if ar >= rs + ag else "intra"
                    rest = (chunks - 1) * max(ar, rs + ag)
                    phases += (PhaseTime(f"chunks 2..{chunks}", link, rest),)
            self._chosen[nbytes] = (pick.algorithm, pick.chunks, phases)
        return self._chosen[nbytes]

    def ring_half(self, nbytes: int, name: str) -> tuple[PhaseTime, ...]:
        """A ring all-gather or reduce-scatter: ``P-1`` steps of ``n/P``."""
        if self.size < 2:
            return ()
        step, link = self.ring_step(nbytes)
        return (PhaseTime(name, link, (self.size - 1) * step),)

    def all_to_all(self, nbytes: int) -> tuple[PhaseTime, ...]:
        """Pairwise exchange: ``L-1`` intra and ``P-L`` inter messages of ``n/P``."""
        layout = self.model.layout
        local, chunk = layout.per_host, nbytes / self.size
        out = []
        if local > 1:
            out.append(PhaseTime("exchange", "intra", (local - 1) * self.model.intra.time(chunk)))
        remote = self.size - local
        if remote > 0:
            out.append(PhaseTime("exchange", "inter", remote * self.model.inter.time(chunk, local)))
        return tuple(out)

    def describe(self) -> str:
        layout = self.model.layout
        return (
            f"{self.label}: {self.size:,} rank(s) on {layout.host_count} host(s) x "
            f"{layout.per_host}; all-reduce algorithms {list(self.allowed)}"
        )


class _Groups:
    """Axis label -> simulated group, built on first use."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._by_kind: dict[str, _Group] = {}

    def of(self, axis: str) -> _Group:
        parts = set(axis.split("+"))
        kind = "intra" if parts == {"intra"} else "inter" if parts == {"inter"} else "world"
        if kind not in self._by_kind:
            c = self.cluster
            if kind == "intra":
                group = _Group("intra (one host's ranks)", c.host_model(), c.hosts == 1)
            elif kind == "inter":
                label = f"inter (one rank per host, {c.devices_per_host} such groups at once)"
                group = _Group(label, c.rail_model(), c.devices_per_host == 1)
            else:
                group = _Group(f"{axis} (the whole cluster)", c.cost_model(), True)
            self._by_kind[kind] = group
        return self._by_kind[kind]

    def described(self) -> tuple[str, ...]:
        return tuple(g.describe() for g in self._by_kind.values())


# -- prediction ---------------------------------------------------------------------------


def modelled_op(node: PlanNode) -> str:
    """The collective a node performs, whatever primitive the capture's backend used for
    it (gloo gathers by broadcast and reduce-scatters by all-to-all)."""
    spec = node.collective
    assert spec is not None
    if node.kind == "gather":
        return "all_gather"
    if node.scatters_gradient:
        return "reduce_scatter"
    return spec.op


def predict_collective(groups: _Groups, node: PlanNode) -> CollectiveTime:
    """The time of one collective node on the simulated group of its axis."""
    spec = node.collective
    if spec is None:
        raise ConfigError(f"plan node {node.id!r} is not a collective")
    group = groups.of(spec.axis)
    op = modelled_op(node)
    nbytes = spec.nbytes
    algorithm, chunks = "ring", 1
    if op == "all_reduce":
        algorithm, chunks, phases = group.all_reduce(nbytes)
    elif op == "all_gather":
        phases = group.ring_half(nbytes, "all-gather")
    elif op == "reduce_scatter":
        phases = group.ring_half(nbytes, "reduce-scatter")
    elif op == "broadcast":
        algorithm = "scatter+all-gather"
        phases = group.ring_half(nbytes, "scatter") + group.ring_half(nbytes, "all-gather")
    elif op == "all_to_all":
        algorithm = "pairwise"
        phases = group.all_to_all(nbytes) if group.size > 1 else ()
    else:
        raise ConfigError(
            f"plan node {node.id!r}: collective {op!r} has no model; lamina plan --simulate "
            "models all_reduce, all_gather, reduce_scatter, broadcast and all_to_all"
        )
    return CollectiveTime(
        node.id, op, node.phase, nbytes, group.size, spec.axis, algorithm, chunks, phases
    )


def replica_all_reduce(groups: _Groups, scatter: PlanNode, axis: str) -> CollectiveTime:
    """The all-reduce of one unit's shard gradient across the replicas (HSDP), after the
    unit's reduce-scatter ``scatter``: ``ceil(n_u / N)`` elements with ``N`` the simulated
    shard group. Derived from the unit, not read from the plan: a capture on one host has
    a single replica (no such node), and the capture's shard is not the simulated one."""
    spec = scatter.collective
    assert spec is not None
    shard = groups.of(spec.axis).size
    nbytes = -(-spec.numel // shard) * spec.element_size
    group = groups.of(axis)
    algorithm, chunks, phases = group.all_reduce(nbytes)
    return CollectiveTime(
        f"{scatter.unit}.all_reduce.replicas",
        "all_reduce",
        scatter.phase,
        nbytes,
        group.size,
        axis,
        algorithm,
        chunks,
        phases,
    )


def predict(
    plan: ExecutionPlan,
    cluster: Cluster,
    *,
    optimizer_bytes_per_param: float = ADAMW_BYTES_PER_PARAM,
) -> StepPrediction:
    """Predict ``plan``'s per-step communication and per-rank memory on ``cluster``."""
    groups = _Groups(cluster)
    per_step: list[CollectiveTime] = []
    once: list[CollectiveTime] = []
    replicate_axis = plan.replicate_axis
    for node in plan.collectives():
        collective = node.facts(Collective)
        if replicate_axis and collective is not None and collective.purpose == "replicate":
            continue  # sized for the capture's shard group: derived again below
        timed = predict_collective(groups, node)
        (once if node.phase == "setup" else per_step).append(timed)
        if replicate_axis and node.scatters_gradient:
            per_step.append(replica_all_reduce(groups, node, replicate_axis))
    memory = estimate_memory(plan, cluster, groups, optimizer_bytes_per_param)
    return StepPrediction(
        cluster=cluster,
        strategy=plan.strategy,
        captured_world_size=plan.world_size,
        per_step=tuple(per_step),
        once=tuple(once),
        memory=memory,
        assumptions=assumptions(plan, cluster, optimizer_bytes_per_param),
        groups=groups.described(),
    )


def estimate_memory(
    plan: ExecutionPlan,
    cluster: Cluster,
    groups: _Groups | None = None,
    optimizer_bytes_per_param: float = ADAMW_BYTES_PER_PARAM,
) -> MemoryEstimate:
    """Per-rank model state of ``plan`` on ``cluster`` (see the module docstring)."""
    groups = groups or _Groups(cluster)
    gathers = [n for n in plan.collectives() if n.kind == "gather"]
    device = cluster.device_memory_bytes
    if gathers:
        return _sharded_memory(plan, groups, gathers, optimizer_bytes_per_param, device)
    grads = [
        n.collective
        for n in plan.collectives()
        if n.collective is not None and n.collective.op == "all_reduce" and n.phase == "backward"
    ]
    if not grads:
        raise ConfigError(
            f"the {plan.strategy} plan has no gradient all-reduce and no parameter gather "
            f"(captured on {plan.world_size} rank(s)); capture it on 2 or more ranks"
        )
    psi = sum(s.numel for s in grads)
    elem = sum(s.numel * s.element_size for s in grads) / psi if psi else 0.0
    return MemoryEstimate(
        plan.strategy,
        1,
        psi,
        psi,
        elem,
        elem,
        optimizer_bytes_per_param,
        device_memory_bytes=device,
    )


def _sharded_memory(
    plan: ExecutionPlan,
    groups: _Groups,
    gathers: list[PlanNode],
    k: float,
    device: int | None,
) -> MemoryEstimate:
    # one entry per unit: (numel, shard element size, gathered bytes, whole forward)
    units: dict[str, tuple[int, int, int, bool]] = {}
    scatter_size: dict[str, int] = {}
    for node in plan.collectives():
        if node.scatters_gradient and node.collective is not None:
            scatter_size[node.unit] = node.collective.element_size
    shard_group = 1
    for node in gathers:
        spec, gather = node.collective, node.facts(Gather)
        assert spec is not None and gather is not None
        unit = gather.unit
        shard_group = max(shard_group, groups.of(spec.axis).size)
        size = scatter_size.get(unit, spec.element_size)
        kept = gather.span == "whole_forward"
        old = units.get(unit)
        units[unit] = (spec.numel, size, spec.nbytes, kept or (old is not None and old[3]))
    psi = sum(n for n, _, _, _ in units.values())
    local = sum(-(-n // shard_group) for n, _, _, _ in units.values())
    elem = sum(n * s for n, s, _, _ in units.values()) / psi if psi else 0.0
    # gathered parameters + the full gradient (shard dtype) until its reduce-scatter
    held = {u: g + n * s for u, (n, s, g, _) in units.items()}
    whole = [u for u, v in units.items() if v[3]]
    others = [u for u in units if u not in whole]
    largest = max(others, key=lambda u: held[u], default=None)
    gathered = sum(held[u] for u in whole) + (held[largest] if largest else 0)
    parts = [f"{u} {format_bytes(held[u])}" for u in whole]
    if largest is not None:
        parts.append(f"largest other unit {largest} {format_bytes(held[largest])}")
    what = "gathered params + full grads: " + ", ".join(parts) if parts else ""
    return MemoryEstimate(
        plan.strategy, shard_group, psi, local, elem, elem, k, gathered, what, device
    )


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


__all__ = [
    "ADAMW_BYTES_PER_PARAM",
    "CollectiveTime",
    "MemoryEstimate",
    "PhaseTime",
    "StepPrediction",
    "estimate_memory",
    "predict",
    "predict_collective",
    "replica_all_reduce",
]
