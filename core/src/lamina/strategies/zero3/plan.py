"""The execution plan of one ZeRO-3 (or HSDP) step, from the shard layout and unit order.

Gathers and reduce-scatters run on the shard group (its mesh axes); with replica axes
(HSDP) each reduce-scatter is followed by an all-reduce of the shard gradient across
the replicas; the wrap-time broadcast spans the whole job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lamina.comm.codecs import TwoPhaseCodec
from lamina.comm.cost import AlgorithmChoice
from lamina.dtypes import dtype_from_name, dtype_name
from lamina.memory.layout import ShardLayout, UnitLayout
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.runtime.nodes import (
    CodecFact,
    Collective,
    Compute,
    Free,
    Gather,
    GatherSpan,
    Slot,
    UnitFact,
)
from lamina.runtime.plan import CollectiveSpec, ExecutionPlan, Fallback, PlanNode, meta_items
from lamina.runtime.primitives import PrimitiveChoice
from lamina.strategies.algorithm_nodes import (
    algorithm_fact,
    algorithm_fallback,
    records_algorithm,
)
from lamina.strategies.codec_nodes import error_feedback_meta, two_phase_fallback

OPTIMIZER = "optimizer"


def gather_node(unit: str, phase: str) -> str:
    """Node id of ``unit``'s parameter gather in ``phase`` ("fwd" or "bwd")."""
    return f"{unit}.gather.{phase}"


def scatter_node(unit: str) -> str:
    """Node id of ``unit``'s gradient reduce-scatter."""
    return f"{unit}.reduce_scatter"


def replicate_node(unit: str) -> str:
    """Node id of the all-reduce of ``unit``'s shard gradient across replicas (HSDP)."""
    return f"{unit}.all_reduce.replicas"


@dataclass(frozen=True)
class PlanGroups:
    """The groups a sharded step uses: global ranks of this rank's group and axis label.

    ``replicate`` is empty without replica axes (plain ZeRO-3); ``everyone`` is the job.
    """

    shard: tuple[int, ...]
    shard_axis: str
    replicate: tuple[int, ...] = ()
    replicate_axis: str = ""
    everyone: tuple[int, ...] = ()
    everyone_axis: str = "world"


@dataclass(frozen=True)
class Zero3PlanInputs:
    """Everything the ZeRO-3 plan depends on."""

    layout: ShardLayout
    #: Unit names in forward order; ``whole_forward`` ones are gathered for all of it.
    forward_order: Sequence[str]
    whole_forward: frozenset[str]
    groups: PlanGroups
    backend: str
    pg_backend: str
    gather: PrimitiveChoice
    scatter: PrimitiveChoice
    setup_state: Sequence[tuple[str, int]]
    compute_dtype: str | None = None
    reshard_after_forward: bool = True
    strategy: str = "zero3"
    #: Units kept gathered from their forward to their backward even when resharding
    #: after forward: backward needs them first, or (whole-forward units) needs them
    #: until its end anyway, so freeing them would only add a gather.
    kept_for_backward: frozenset[str] = frozenset()
    #: Unit name -> the algorithm of its gathers and reduce-scatter (absent: flat), and
    #: the cost model that chose them.
    algorithms: Mapping[str, AlgorithmChoice] | None = None
    cost_model: str = ""
    #: A two-phase codec for the gradient: ZeRO-3's reduce-scatter, or HSDP's replica
    #: all-reduce.
    codec: TwoPhaseCodec | None = None
    #: Units whose parameters are all frozen (``requires_grad=False``): gathered for the
    #: forward, and again for backward where activations need their weights, but never
    #: reduce-scattered (no gradient, no optimizer step).
    frozen_units: frozenset[str] = frozenset()
    #: Where ``forward_order`` comes from: ``planned`` (whole-forward units, then the
    #: layout's order) or ``recorded at step 1`` (the first forward's, filled in then).
    order_source: str = "planned"

    def codec_role(self) -> str:
        """Which gradient collective the codec compresses ('' without one)."""
        replicas = len(self.groups.replicate)
        if self.codec is None or len(self.groups.shard) * max(1, replicas) == 1:
            return ""
        return "replicate" if len(self.groups.replicate) > 1 else "scatter"

    def algorithm_of(self, unit: str) -> AlgorithmChoice | None:
        """The algorithm choice of ``unit`` (None: flat, nothing chosen)."""
        return (self.algorithms or {}).get(unit)

    def reshards(self, unit: str) -> bool:
        """Whether ``unit`` is freed after its forward and gathered again for backward."""
        return self.reshard_after_forward and unit not in self.kept_for_backward


def _gather_spec(inputs: Zero3PlanInputs, unit: UnitLayout) -> CollectiveSpec:
    dtype = inputs.compute_dtype or unit.dtype
    size = dtype_from_name(dtype).itemsize
    groups = inputs.groups
    return CollectiveSpec(
        inputs.gather.op, dtype, unit.total_numel, size, groups.shard, axis=groups.shard_axis
    )


def _wire(inputs: Zero3PlanInputs, role: str) -> tuple[str | None, int | None]:
    """The wire dtype and element size of ``role``'s collective (None: uncompressed)."""
    codec = inputs.codec
    if codec is None or inputs.codec_role() != role:
        return None, None
    return dtype_name(codec.wire_dtype), codec.wire_dtype.itemsize


def _scatter_spec(inputs: Zero3PlanInputs, unit: UnitLayout) -> CollectiveSpec:
    groups = inputs.groups
    wire_dtype, wire_size = _wire(inputs, "scatter")
    return CollectiveSpec(
        "all_to_all" if wire_dtype else inputs.scatter.op,
        unit.dtype,
        unit.total_numel,
        unit.element_size,
        groups.shard,
        wire_dtype=wire_dtype,
        wire_element_size=wire_size,
        axis=groups.shard_axis,
    )


def _replicate_spec(inputs: Zero3PlanInputs, unit: UnitLayout) -> CollectiveSpec:
    groups = inputs.groups
    wire_dtype, wire_size = _wire(inputs, "replicate")
    return CollectiveSpec(
        "all_reduce",
        unit.dtype,
        unit.shard_numel,
        unit.element_size,
        groups.replicate,
        wire_dtype=wire_dtype,
        wire_element_size=wire_size,
        axis=groups.replicate_axis,
    )


def _codec_fact(inputs: Zero3PlanInputs, unit: UnitLayout, role: str) -> CodecFact | None:
    """The codec of ``unit``'s ``role`` collective (None when not compressed)."""
    codec = inputs.codec
    if codec is None or inputs.codec_role() != role:
        return None
    if role == "scatter":
        residual = codec.scatter_residual_bytes(unit.total_numel, len(inputs.groups.shard))
    else:
        residual = codec.residual_bytes(unit.shard_numel, len(inputs.groups.replicate))
    scope = "all" if role == "scatter" else "replicas"
    return CodecFact(codec.name, scope, codec.error_feedback, residual)


def build_zero3_plan(inputs: Zero3PlanInputs) -> ExecutionPlan:
    """Per unit: gather before its forward, free after it, gather again for backward,
    reduce-scatter its gradient into the shard, free; then the optimizer on the shards.
    A frozen unit has no reduce-scatter (nor replica all-reduce): backward only reads its
    weights, where the activations before it need them."""
    units = {u.name: u for u in inputs.layout.units}
    order = [units[name] for name in inputs.forward_order]
    nodes: list[PlanNode] = []
    edges: list[tuple[str, str]] = []
    fallbacks: list[Fallback] = []
    groups = inputs.groups
    world = len(groups.everyone) or len(groups.shard)
    if world > 1:
        nodes += broadcast_nodes(
            "setup", inputs.setup_state, groups.everyone or groups.shard, groups.everyone_axis
        )
    previous = ""
    for unit in order:  # forward
        gather = gather_node(unit.name, "fwd")
        whole = unit.name in inputs.whole_forward
        span = "the whole forward" if whole else "its forward"
        nodes.append(
            _gather(
                inputs,
                unit,
                gather,
                "whole_forward" if whole else "forward",
                f"gather {unit.name} for {span}",
            )
        )
        compute = f"{unit.name}.forward"
        nodes.append(
            PlanNode(compute, "forward", "forward", f"forward of {unit.name}", Compute(unit.name))
        )
        edges.append((gather, compute))
        if previous:
            edges.append((previous, compute))
        previous = compute
        if inputs.reshards(unit.name):
            free = f"{unit.name}.free.fwd"
            label = f"free {unit.name} after forward"
            nodes.append(PlanNode(free, "free", "forward", label, Free(unit.name)))
            edges.append((compute, free))
    for unit in reversed(order):  # backward
        compute = f"{unit.name}.backward"
        label = f"backward of {unit.name}"
        nodes.append(PlanNode(compute, "backward", "backward", label, Compute(unit.name)))
        edges.append((previous, compute))
        frozen = unit.name in inputs.frozen_units
        if inputs.reshards(unit.name):
            gather = gather_node(unit.name, "bwd")
            again = "if backward reads its weights" if frozen else "again"
            nodes.append(_gather(inputs, unit, gather, "backward", f"gather {unit.name} {again}"))
            edges.append((gather, compute))
        if frozen:  # no gradient: backward reads the weights only
            free = f"{unit.name}.free.bwd"
            label = f"free {unit.name} after backward"
            nodes.append(PlanNode(free, "free", "backward", label, Free(unit.name)))
            edges.append((compute, free))
            previous = compute
            continue
        scatter = scatter_node(unit.name)
        nodes.append(
            PlanNode(
                scatter,
                "collective",
                "backward",
                f"mean gradient of {unit.name} into the shards",
                Collective(
                    "gradient",
                    unit=unit.name,
                    primitive=inputs.scatter.op,
                    algorithm=algorithm_fact(inputs.algorithm_of(unit.name)),
                    codec=_codec_fact(inputs, unit, "scatter"),
                ),
                _scatter_spec(inputs, unit),
            )
        )
        edges.append((compute, scatter))
        done = scatter  # the shard gradient is final after this node
        if len(groups.replicate) > 1:
            replicate = replicate_node(unit.name)
            nodes.append(
                PlanNode(
                    replicate,
                    "collective",
                    "backward",
                    f"mean of {unit.name}'s shard gradient across the replicas",
                    Collective(
                        "replicate", unit=unit.name, codec=_codec_fact(inputs, unit, "replicate")
                    ),
                    _replicate_spec(inputs, unit),
                )
            )
            edges.append((scatter, replicate))
            done = replicate
        free = f"{unit.name}.free.bwd"
        label = f"free {unit.name} after backward"
        nodes.append(PlanNode(free, "free", "backward", label, Free(unit.name)))
        edges += [(done, free), (done, OPTIMIZER)]
        previous = compute
    label = "optimizer step on the flat shards"
    nodes.append(PlanNode(OPTIMIZER, "optimizer", "step", label, Compute()))
    for node in nodes:
        if node.codec is not None and inputs.codec is not None:
            fallbacks.append(two_phase_fallback(node.id, inputs.codec))
        if node.kind == "gather":
            fallbacks.append(_fallback(node.id, inputs.gather))
        elif node.scatters_gradient:
            fallbacks.append(_fallback(node.id, inputs.scatter))
        else:
            continue
        choice = inputs.algorithm_of(node.unit)
        if choice is not None and records_algorithm(choice):
            fallbacks.append(algorithm_fallback(node.id, choice))
    return ExecutionPlan(
        strategy=inputs.strategy,
        world_size=world,
        backend=inputs.backend,
        nodes=tuple(nodes),
        edges=tuple(edges),
        fallbacks=tuple(fallbacks),
        graph_fingerprint=inputs.layout.fingerprint(),
        replicate_axis=groups.replicate_axis,
        meta=meta_items(
            pg_backend=inputs.pg_backend,
            compute_dtype=inputs.compute_dtype or "shard dtype",
            reshard_after_forward=inputs.reshard_after_forward,
            kept_for_backward=",".join(sorted(inputs.kept_for_backward)) or "none",
            units=len(order),
            forward_order=inputs.order_source,
            shard_axis=groups.shard_axis,
            replicate_axis=groups.replicate_axis or "none",
            **({"cost_model": inputs.cost_model} if inputs.cost_model else {}),
            **(
                {"frozen_units": ",".join(sorted(inputs.frozen_units))}
                if inputs.frozen_units
                else {}
            ),
            **error_feedback_meta(nodes),
        ),
    )


def unit_fact(unit: UnitLayout) -> UnitFact:
    """``unit``'s layout as the plan records it."""
    slots = tuple(Slot(p.name, p.shape, p.full_offset) for p in unit.params)
    return UnitFact(unit.index, unit.dtype, slots, unit.alignment_bytes)


def _gather(
    inputs: Zero3PlanInputs, unit: UnitLayout, node_id: str, span: GatherSpan, label: str
) -> PlanNode:
    return PlanNode(
        node_id,
        "gather",
        "backward" if span == "backward" else "forward",
        label,
        Gather(
            unit.name,
            span,
            primitive=inputs.gather.op,
            frozen=unit.name in inputs.frozen_units,
            algorithm=algorithm_fact(inputs.algorithm_of(unit.name)),
            layout=unit_fact(unit) if span != "backward" else None,
        ),
        _gather_spec(inputs, unit),
    )


def _fallback(node_id: str, choice: PrimitiveChoice) -> Fallback:
    return Fallback(
        node_id,
        choice.requested,
        choice.alternative,
        f"{choice.requested} disabled, missing on the backend, or slower there",
        taken=choice.fell_back,
        reason=choice.reason,
    )


def shard_lines(layout: ShardLayout) -> tuple[str, ...]:
    """The pre-flight manifest's ``shards`` category: one line per unit of the layout
    (sizes, and each parameter's shape, rows per rank and chunk offset)."""
    return tuple(
        f"unit {u.index} {u.name}: {u.dtype} world_size={u.world_size} "
        f"align={u.alignment_bytes} shard_numel={u.shard_numel} params=["
        + ", ".join(f"{p.name}{list(p.shape)}/{p.rows}@{p.offset}" for p in u.params)
        + "]"
        for u in layout.units
    )
