"""The execution plan of one ZeRO-3 step, from the shard layout and the unit order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lamina.dtypes import dtype_from_name
from lamina.memory.layout import ShardLayout, UnitLayout
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.runtime.plan import CollectiveSpec, ExecutionPlan, Fallback, PlanNode, attrs
from lamina.runtime.primitives import PrimitiveChoice

OPTIMIZER = "optimizer"


def gather_node(unit: str, phase: str) -> str:
    """Node id of ``unit``'s parameter gather in ``phase`` ("fwd" or "bwd")."""
    return f"{unit}.gather.{phase}"


def scatter_node(unit: str) -> str:
    """Node id of ``unit``'s gradient reduce-scatter."""
    return f"{unit}.reduce_scatter"


@dataclass(frozen=True)
class Zero3PlanInputs:
    """Everything the ZeRO-3 plan depends on."""

    layout: ShardLayout
    #: Unit names in forward order; ``whole_forward`` ones are gathered for all of it.
    forward_order: Sequence[str]
    whole_forward: frozenset[str]
    group: tuple[int, ...]
    backend: str
    pg_backend: str
    gather: PrimitiveChoice
    scatter: PrimitiveChoice
    setup_state: Sequence[tuple[str, int]]
    compute_dtype: str | None = None
    reshard_after_forward: bool = True


def _gather_spec(inputs: Zero3PlanInputs, unit: UnitLayout) -> CollectiveSpec:
    dtype = inputs.compute_dtype or unit.dtype
    size = dtype_from_name(dtype).itemsize
    return CollectiveSpec(inputs.gather.op, dtype, unit.total_numel, size, inputs.group)


def _scatter_spec(inputs: Zero3PlanInputs, unit: UnitLayout) -> CollectiveSpec:
    return CollectiveSpec(
        inputs.scatter.op, unit.dtype, unit.total_numel, unit.element_size, inputs.group
    )


def build_zero3_plan(inputs: Zero3PlanInputs) -> ExecutionPlan:
    """Per unit: gather before its forward, free after it, gather again for backward,
    reduce-scatter its gradient into the shard, free; then the optimizer on the shards."""
    units = {u.name: u for u in inputs.layout.units}
    order = [units[name] for name in inputs.forward_order]
    nodes: list[PlanNode] = []
    edges: list[tuple[str, str]] = []
    fallbacks: list[Fallback] = []
    world = len(inputs.group)
    if world > 1:
        nodes += broadcast_nodes("setup", inputs.setup_state, inputs.group)
    previous = ""
    for unit in order:  # forward
        gather = gather_node(unit.name, "fwd")
        span = "the whole forward" if unit.name in inputs.whole_forward else "its forward"
        nodes.append(_gather(inputs, unit, gather, "forward", f"gather {unit.name} for {span}"))
        compute = f"{unit.name}.forward"
        nodes.append(PlanNode(compute, "forward", "forward", f"forward of {unit.name}"))
        edges.append((gather, compute))
        if previous:
            edges.append((previous, compute))
        previous = compute
        if inputs.reshard_after_forward:
            free = f"{unit.name}.free.fwd"
            nodes.append(PlanNode(free, "free", "forward", f"free {unit.name} after forward"))
            edges.append((compute, free))
    for unit in reversed(order):  # backward
        compute = f"{unit.name}.backward"
        nodes.append(PlanNode(compute, "backward", "backward", f"backward of {unit.name}"))
        edges.append((previous, compute))
        if inputs.reshard_after_forward:
            gather = gather_node(unit.name, "bwd")
            nodes.append(_gather(inputs, unit, gather, "backward", f"gather {unit.name} again"))
            edges.append((gather, compute))
        scatter = scatter_node(unit.name)
        nodes.append(
            PlanNode(
                scatter,
                "collective",
                "backward",
                f"mean gradient of {unit.name} into the shards",
                _scatter_spec(inputs, unit),
                attrs(unit=unit.name, primitive=inputs.scatter.op),
            )
        )
        free = f"{unit.name}.free.bwd"
        nodes.append(PlanNode(free, "free", "backward", f"free {unit.name} after backward"))
        edges += [(compute, scatter), (scatter, free), (scatter, OPTIMIZER)]
        previous = compute
    nodes.append(PlanNode(OPTIMIZER, "optimizer", "step", "optimizer step on the flat shards"))
    for node in nodes:
        if node.kind == "gather":
            fallbacks.append(
                _fallback(node.id, inputs.gather, "all_reduce of a zero-filled buffer")
            )
        elif node.id.endswith(".reduce_scatter"):
            fallbacks.append(_fallback(node.id, inputs.scatter, "all_reduce + slice"))
    return ExecutionPlan(
        strategy="zero3",
        world_size=world,
        backend=inputs.backend,
        nodes=tuple(nodes),
        edges=tuple(edges),
        fallbacks=tuple(fallbacks),
        graph_fingerprint=inputs.layout.fingerprint(),
        meta=attrs(
            pg_backend=inputs.pg_backend,
            compute_dtype=inputs.compute_dtype or "shard dtype",
            reshard_after_forward=inputs.reshard_after_forward,
            units=len(order),
        ),
    )


def _gather(
    inputs: Zero3PlanInputs, unit: UnitLayout, node_id: str, phase: str, label: str
) -> PlanNode:
    return PlanNode(
        node_id,
        "gather",
        phase,
        label,
        _gather_spec(inputs, unit),
        attrs(unit=unit.name, primitive=inputs.gather.op),
    )


def _fallback(node_id: str, choice: PrimitiveChoice, alternative: str) -> Fallback:
    return Fallback(
        node_id,
        choice.requested,
        alternative,
        f"{choice.requested} disabled, missing on the backend, or slower there",
        taken=choice.fell_back,
        reason=choice.reason,
    )
