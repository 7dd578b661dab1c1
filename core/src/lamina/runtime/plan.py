"""The execution plan: the DAG of one training step that a strategy builds and runs.

Nodes are compute units (forward, backward, the optimizer step, of a stage and a
microbatch where they apply), collectives (op, dtype, element count, process group, and
the bucket or unit they serve, their algorithm and codec), parameter gathers and frees,
and pipeline sends and recvs; each kind's facts are a typed dataclass
(:mod:`lamina.runtime.nodes`). Edges are data dependencies. Every preferred path that has a declared
alternative carries a :class:`Fallback` with the condition that triggers it; a fallback
decided while planning (capture, collective primitive, codec self-check) is part of the
plan and of its fingerprint, one taken while running (compiled forward, codec overflow)
is recorded in :class:`~lamina.runtime.log.RunLog`. Engines read their collectives,
primitives, codecs and compute mode from the plan's nodes, so the plan is what runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from lamina.errors import ConfigError
from lamina.runtime.node_json import detail_from_dict, detail_to_dict
from lamina.runtime.nodes import (
    DETAIL_OF_KIND,
    AlgorithmFact,
    CodecFact,
    Collective,
    Compute,
    Free,
    Gather,
    NodeDetail,
)
from lamina.units import format_bytes

#: 2: each node's facts are a typed ``detail`` (1 held them as ``attrs`` strings).
PLAN_VERSION = 2
D = TypeVar("D")

#: Collective ops a plan node may issue.
COLLECTIVE_OPS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
)


@dataclass(frozen=True)
class CollectiveSpec:
    """One collective a node issues: what, how big, over which ranks.

    ``numel`` counts elements of the full buffer (the gathered output of an all-gather,
    the input of a reduce-scatter); ``wire_dtype`` is the dtype on the wire when a codec
    compresses it (``None``: ``dtype``). ``group`` is the global ranks of this rank's group
    and ``axis`` the mesh axis (or axes, ``"inter+intra"``) the group spans: ``"world"``
    for the whole job. Ranks of different groups on one axis hold different ``group``
    lists; what they must agree on is the axis and the group size.
    """

    op: str
    dtype: str
    numel: int
    element_size: int
    group: tuple[int, ...]
    wire_dtype: str | None = None
    wire_element_size: int | None = None
    axis: str = "world"

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer as it travels (after any codec)."""
        return self.numel * (self.wire_element_size or self.element_size)

    def describe(self) -> str:
        """``all_reduce float32 x 1024 (4.0 KiB) on intra [0, 1]`` (this rank's group)."""
        return f"{self._what()} on {self.axis} {list(self.group)}"

    def canonical(self) -> str:
        """``all_reduce float32 x 1024 (4.0 KiB) on intra (2 ranks)``: the same text on every
        rank of a job, whichever group of the axis the rank is in."""
        return f"{self._what()} on {self.axis} ({len(self.group)} ranks)"

    def _what(self) -> str:
        wire = f" as {self.wire_dtype}" if self.wire_dtype else ""
        return f"{self.op} {self.dtype}{wire} x {self.numel} ({format_bytes(self.nbytes)})"


@dataclass(frozen=True)
class PlanNode:
    """One task of the step: its ``kind``'s typed facts in ``detail``
    (:data:`~lamina.runtime.nodes.DETAIL_OF_KIND`), and for collectives and gathers the
    collective it issues. ``label`` is for people only: nothing reads it back."""

    id: str
    kind: str
    phase: str
    label: str
    detail: NodeDetail
    collective: CollectiveSpec | None = None

    def __post_init__(self) -> None:
        expected = DETAIL_OF_KIND.get(self.kind)
        if expected is None:
            raise ConfigError(
                f"execution plan node {self.id!r} has unknown kind {self.kind!r}; "
                f"use one of {', '.join(DETAIL_OF_KIND)}"
            )
        if not isinstance(self.detail, expected):
            raise ConfigError(
                f"execution plan node {self.id!r} ({self.kind}) holds a "
                f"{type(self.detail).__name__}; a {self.kind} node holds a {expected.__name__}"
            )
        if (self.collective is None) == (self.kind in ("collective", "gather")):
            needs = "needs" if self.collective is None else "has no use for"
            raise ConfigError(f"execution plan node {self.id!r} ({self.kind}) {needs} a collective")

    def facts(self, kind: type[D]) -> D | None:
        """``detail`` when it is a ``kind`` (None otherwise): ``node.facts(Collective)``."""
        return self.detail if isinstance(self.detail, kind) else None

    @property
    def algorithm(self) -> AlgorithmFact | None:
        """The algorithm this node's collective runs (None: flat, nothing chosen)."""
        detail = self.detail
        return detail.algorithm if isinstance(detail, (Collective, Gather)) else None

    @property
    def codec(self) -> CodecFact | None:
        """The codec this node's collective travels in (None: uncompressed)."""
        return self.detail.codec if isinstance(self.detail, Collective) else None

    @property
    def scatters_gradient(self) -> bool:
        """Whether this node reduces a ZeRO-3 unit's gradient into the shards."""
        detail = self.detail
        return isinstance(detail, Collective) and detail.purpose == "gradient" and bool(detail.unit)

    @property
    def unit(self) -> str:
        """The ZeRO-3 unit this node serves (``""``: none)."""
        detail = self.detail
        return detail.unit if isinstance(detail, (Collective, Gather, Free, Compute)) else ""


@dataclass(frozen=True)
class Fallback:
    """A declared alternative to a node's preferred path.

    ``taken`` is decided while planning; ``reason`` says why it was taken.
    ``when`` is ``"plan"`` (decided before step 1) or ``"run"`` (checked every time the
    node runs; what happened is in the run log).
    """

    node: str
    primary: str
    alternative: str
    condition: str
    when: str = "plan"
    taken: bool = False
    reason: str = ""


@dataclass(frozen=True)
class ExecutionPlan:
    """The per-step DAG of one wrapped model; identical on every rank of a job."""

    strategy: str
    world_size: int
    backend: str
    nodes: tuple[PlanNode, ...]
    edges: tuple[tuple[str, str], ...]
    fallbacks: tuple[Fallback, ...] = ()
    graph_fingerprint: str = ""
    #: Descriptive facts of the whole plan, for people (``lamina plan`` prints them).
    meta: tuple[tuple[str, str], ...] = ()
    #: The mesh axis (or axes) a sharded gradient is averaged across after its
    #: reduce-scatter (HSDP's replicas; ``""`` without): the simulator sizes the replica
    #: all-reduces of a capture that had a single replica from it.
    replicate_axis: str = ""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        index = {node.id: k for k, node in enumerate(self.nodes)}
        if len(index) != len(self.nodes):
            ids = [n.id for n in self.nodes]
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ConfigError(f"execution plan: node id {dup!r} appears twice")
        for src, dst in self.edges:
            for end in (src, dst):
                if end not in index:
                    raise ConfigError(f"execution plan: edge {src} -> {dst} names no node {end!r}")
        for fb in self.fallbacks:
            if fb.node not in index:
                raise ConfigError(f"execution plan: fallback names no node {fb.node!r}")
        self._index.update(index)

    # -- queries --------------------------------------------------------------------------
    def node(self, node_id: str) -> PlanNode:
        """The node called ``node_id`` (KeyError naming it when absent)."""
        try:
            return self.nodes[self._index[node_id]]
        except KeyError:
            raise KeyError(f"execution plan has no node {node_id!r}") from None

    def collectives(self) -> list[PlanNode]:
        """Collective nodes in the order one step issues them."""
        return [n for n in self.nodes if n.collective is not None]

    def fallbacks_of(self, node_id: str) -> list[Fallback]:
        """Fallbacks declared on ``node_id``."""
        return [f for f in self.fallbacks if f.node == node_id]

    def taken(self, node_id: str, alternative: str) -> bool:
        """Whether the plan decided to use ``alternative`` on ``node_id``."""
        return any(f.taken and f.alternative == alternative for f in self.fallbacks_of(node_id))

    def topological_order(self) -> list[str]:
        """Node ids in an order that respects every edge (ties keep plan order)."""
        incoming: dict[str, int] = {n.id: 0 for n in self.nodes}
        outgoing: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for src, dst in self.edges:
            incoming[dst] += 1
            outgoing[src].append(dst)
        ready = [n.id for n in self.nodes if incoming[n.id] == 0]
        order: list[str] = []
        while ready:
            ready.sort(key=self._index.__getitem__)
            current = ready.pop(0)
            order.append(current)
            for nxt in outgoing[current]:
                incoming[nxt] -= 1
                if incoming[nxt] == 0:
                    ready.append(nxt)
        if len(order) != len(self.nodes):
            stuck = sorted(set(incoming) - set(order))
            raise ConfigError(f"execution plan has a cycle through {stuck[:4]}")
        return order

    # -- verification items --------------------------------------------------------------
    def collective_sequence(self) -> list[str]:
        """One canonical line per collective, in issue order (what ranks must agree on):
        op, dtype, size, mesh axis and group size, the same on every rank."""
        return [f"{n.id}: {n.collective.canonical()}" for n in self.collectives() if n.collective]

    def with_nodes(self, nodes: tuple[PlanNode, ...]) -> ExecutionPlan:
        """This plan with ``nodes`` in place of its own (edges and fallbacks kept): where
        run-time facts fill a node's detail."""
        return dataclasses.replace(self, nodes=nodes, _index={})

    # -- serialization (JSON only at the edges) ----------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``from_dict`` reads it back into an equal plan)."""
        return {**self.to_dict_without_fingerprint(), "fingerprint": self.fingerprint}

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecutionPlan:
        """Read a dict made by :meth:`to_dict`; ConfigError naming the field when malformed."""
        try:
            if data["version"] != PLAN_VERSION:
                raise ConfigError(
                    f"execution plan version {data['version']} is not {PLAN_VERSION}; "
                    "rebuild the plan with this lamina"
                )
            return cls(
                strategy=str(data["strategy"]),
                world_size=int(data["world_size"]),
                backend=str(data["backend"]),
                graph_fingerprint=str(data.get("graph_fingerprint", "")),
                meta=tuple(sorted((str(k), str(v)) for k, v in data.get("meta", {}).items())),
                replicate_axis=str(data.get("replicate_axis", "")),
                nodes=tuple(_node_from(n) for n in data["nodes"]),
                edges=tuple((str(a), str(b)) for a, b in data["edges"]),
                fallbacks=tuple(Fallback(**f) for f in data.get("fallbacks", [])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(
                f"execution plan JSON is malformed ({type(exc).__name__}: {exc}); "
                "write it with ExecutionPlan.to_json"
            ) from None

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical plan (nodes, edges, fallbacks decided; not run events):
        equal on every rank of a job, so group ranks count by their number only."""
        body = self.to_dict_without_fingerprint()
        for node in body["nodes"]:
            if "collective" in node:
                node["collective"]["group"] = len(node["collective"]["group"])
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_dict_without_fingerprint(self) -> dict[str, Any]:
        """The canonical content the fingerprint hashes."""
        return {
            "version": PLAN_VERSION,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "backend": self.backend,
            "graph_fingerprint": self.graph_fingerprint,
            "meta": dict(self.meta),
            "replicate_axis": self.replicate_axis,
            "nodes": [_node_dict(n) for n in self.nodes],
            "edges": [list(e) for e in self.edges],
            "fallbacks": [asdict(f) for f in self.fallbacks],
        }

    def __iter__(self) -> Iterator[PlanNode]:
        return iter(self.nodes)


def _node_dict(node: PlanNode) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": node.id,
        "kind": node.kind,
        "phase": node.phase,
        "label": node.label,
        "detail": detail_to_dict(node.detail),
    }
    if node.collective is not None:
        spec = asdict(node.collective)
        spec["group"] = list(node.collective.group)
        out["collective"] = spec
    return out


def _node_from(data: dict[str, Any]) -> PlanNode:
    kind = str(data["kind"])
    if kind not in DETAIL_OF_KIND:
        raise ConfigError(
            f"execution plan node {data.get('id')!r} has unknown kind {kind!r}; "
            f"use one of {', '.join(DETAIL_OF_KIND)}"
        )
    spec = data.get("collective")
    collective = None
    if spec is not None:
        collective = CollectiveSpec(**{**spec, "group": tuple(int(r) for r in spec["group"])})
    return PlanNode(
        id=str(data["id"]),
        kind=kind,
        phase=str(data["phase"]),
        label=str(data["label"]),
        detail=detail_from_dict(kind, dict(data["detail"]), str(data["id"])),
        collective=collective,
    )


def meta_items(**values: object) -> tuple[tuple[str, str], ...]:
    """The plan's ``meta`` (sorted, stringified): descriptive facts of the whole plan that
    ``lamina plan`` prints; no engine or strategy reads them back (the simulator's report
    names a pipeline's ``schedule`` from them, as a label)."""
    return tuple(sorted((k, str(v)) for k, v in values.items()))
