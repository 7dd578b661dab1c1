"""The ZeRO-3 engine's settings, read from the verified execution plan.

The units' layouts, the gather and reduce-scatter primitives, the units run
hierarchically, the gradient collective the codec compresses, the forward order and
each unit's node ids: read from the nodes' typed facts (:mod:`lamina.runtime.nodes`),
never from their labels, so the engine runs what every rank verified.
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.dtypes import dtype_from_name
from lamina.errors import ConfigError
from lamina.memory import ShardLayout, UnitLayout
from lamina.memory.gather import Primitive
from lamina.runtime import ExecutionPlan
from lamina.runtime.nodes import Collective, Gather
from lamina.strategies.zero3 import plan as plan_z3

#: Plan op of a gather / reduce-scatter node -> the engine's primitive.
PRIMITIVES: dict[str, Primitive] = {
    "all_gather": "native",
    "reduce_scatter": "native",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all",
}


def gather_primitive(plan: ExecutionPlan) -> Primitive:
    """The primitive the plan's first gather node uses (all gathers share it)."""
    gathers = [g for n in plan.nodes if (g := n.facts(Gather)) is not None]
    return PRIMITIVES[gathers[0].primitive if gathers else "all_gather"]


def scatter_primitive(plan: ExecutionPlan) -> Primitive:
    """The primitive the plan's reduce-scatter nodes use."""
    scatters = [c for n in plan.nodes if n.scatters_gradient and (c := n.facts(Collective))]
    return PRIMITIVES[scatters[0].primitive if scatters else "reduce_scatter"]


def hierarchical_units(plan: ExecutionPlan) -> frozenset[str]:
    """The units whose gathers and reduce-scatter the plan runs hierarchically."""
    return frozenset(
        n.unit
        for n in plan.nodes
        if (n.kind == "gather" or n.scatters_gradient)
        and n.algorithm is not None
        and n.algorithm.name == "hierarchical"
    )


def codec_role_of(plan: ExecutionPlan) -> str:
    """The gradient collective the plan compresses: "scatter", "replicate" or ''."""
    for node in plan.collectives():
        if node.codec is not None:
            return "scatter" if node.scatters_gradient else "replicate"
    return ""


@dataclass(frozen=True)
class EngineSettings:
    """What the engine takes from one plan (see :func:`engine_settings`)."""

    #: The primitive of every parameter gather, and of every gradient reduce-scatter.
    gather: Primitive
    scatter: Primitive
    #: Units whose gathers and reduce-scatter run hierarchically.
    hierarchical: frozenset[str]
    #: The gradient collective the codec compresses: "scatter", "replicate" or ''.
    codec_role: str
    #: The ids of the plan's nodes.
    node_ids: frozenset[str]
    #: Units in the plan's forward order (its forward gathers'): the engine prefetches
    #: in this order until the first forward has recorded its own.
    forward_order: tuple[str, ...] = ()

    def unit_nodes(self, unit: str) -> dict[str, str]:
        """The plan's node ids of ``unit``'s collectives, by the engine's name for them."""
        return {
            "fwd": plan_z3.gather_node(unit, "fwd"),
            "bwd": plan_z3.gather_node(unit, "bwd"),
            "scatter": plan_z3.scatter_node(unit),
            "replicate": plan_z3.replicate_node(unit),
        }

    def gathers_for_backward(self, unit: str) -> bool:
        """Whether the plan gathers ``unit`` again for backward."""
        return plan_z3.gather_node(unit, "bwd") in self.node_ids


def plan_layout(plan: ExecutionPlan, planned: ShardLayout) -> ShardLayout:
    """The shard layout the plan's forward gathers record (``Gather.layout``), in layout
    order: the units the engine is built from (``planned``, the layout it was planned
    from, only where the plan has no unit). A ConfigError when the plan's units do not
    add up to that layout (the plan's ``graph_fingerprint``)."""
    units: dict[int, UnitLayout] = {}
    world = alignment = 1
    for node in plan.nodes:
        gather, spec = node.facts(Gather), node.collective
        if gather is None or gather.layout is None or spec is None:
            continue
        fact = gather.layout
        world, alignment = max(1, len(spec.group)), fact.alignment_bytes
        members = [(slot.name, slot.shape) for slot in fact.params]
        dtype = dtype_from_name(fact.dtype)
        unit = UnitLayout.pack(fact.index, gather.unit, dtype, members, world, alignment)
        if [p.full_offset for p in unit.params] != [slot.offset for slot in fact.params]:
            raise ConfigError(f"execution plan node {node.id!r}: its unit's offsets do not pack")
        units.setdefault(fact.index, unit)
    if not units:
        return planned
    layout = ShardLayout(tuple(units[i] for i in sorted(units)), world, alignment)
    if plan.graph_fingerprint and layout.fingerprint() != plan.graph_fingerprint:
        raise ConfigError(
            f"the {plan.strategy} plan's units do not match the shard layout it was planned "
            "from (graph_fingerprint); plan again rather than edit the plan's units"
        )
    return layout


def engine_settings(plan: ExecutionPlan) -> EngineSettings:
    """The engine's settings from ``plan``."""
    return EngineSettings(
        gather=gather_primitive(plan),
        scatter=scatter_primitive(plan),
        hierarchical=hierarchical_units(plan),
        codec_role=codec_role_of(plan),
        node_ids=frozenset(n.id for n in plan.nodes),
        forward_order=forward_order(plan),
    )


def forward_order(plan: ExecutionPlan) -> tuple[str, ...]:
    """The units of the plan's forward gathers, in plan order."""
    return tuple(
        g.unit for n in plan.nodes if (g := n.facts(Gather)) is not None and g.span != "backward"
    )
