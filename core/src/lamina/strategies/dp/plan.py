"""The execution plan of one data-parallel step, from the captured graph and bucket plan."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lamina.comm.buckets import Bucket, BucketPlan, BucketSlot
from lamina.comm.codecs import Codec, TwoPhaseCodec
from lamina.comm.cost import AlgorithmChoice
from lamina.comm.reducer import stray_dtype
from lamina.dtypes import dtype_from_name, dtype_name
from lamina.graph import CAPTURE_METHODS, CapturedGraph
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.runtime.nodes import CodecFact, Collective, Compute, Slot
from lamina.runtime.plan import CollectiveSpec, ExecutionPlan, Fallback, PlanNode, meta_items
from lamina.strategies.algorithm_nodes import (
    algorithm_fact,
    algorithm_fallback,
    records_algorithm,
)
from lamina.strategies.codec_nodes import error_feedback_meta, two_phase_fallback

FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
EXCLUDED = "excluded.all_reduce"


def bucket_node(index: int) -> str:
    """Node id of bucket ``index``'s all-reduce."""
    return f"bucket{index}.all_reduce"


@dataclass(frozen=True)
class DPPlanInputs:
    """Everything the DP plan depends on (identical on every rank of a healthy job)."""

    graph: CapturedGraph
    buckets: BucketPlan
    group: tuple[int, ...]
    backend: str
    pg_backend: str
    #: (dtype name, numel) of the state broadcast at wrap time, and of buffers per step.
    setup_state: Sequence[tuple[str, int]]
    step_buffers: Sequence[tuple[str, int]]
    codec: Codec | None = None
    #: dtype name -> '' when the codec passed its self-check, else the reason it failed.
    codec_checks: dict[str, str] | None = None
    compile_backend: str | None = None
    #: The mesh axis (or axes) the gradient all-reduces span.
    axis: str = "world"
    #: Bucket index -> the all-reduce algorithm chosen for it (absent: flat).
    algorithms: dict[int, AlgorithmChoice] | None = None
    #: One line on the cost model the choices came from.
    cost_model: str = ""
    #: Where a two-phase codec compresses: "all" or "inter" (the inter-host phase).
    codec_scope: str = "all"
    #: Ranks on each host (the hierarchical algorithm's intra-host group size).
    ranks_per_host: int = 1


def _capture_fallbacks(graph: CapturedGraph) -> list[Fallback]:
    failed = {f.method: f.reason for f in graph.fallbacks}
    out = []
    for primary, alternative in itertools.pairwise(CAPTURE_METHODS):
        out.append(
            Fallback(
                node=FORWARD,
                primary=f"capture:{primary}",
                alternative=f"capture:{alternative}",
                condition=f"{primary} capture raises",
                taken=primary in failed,
                reason=failed.get(primary, ""),
            )
        )
    return out


INTER_PHASE = ("hierarchical", "pipelined")


def _codec_applies(inputs: DPPlanInputs, dtype: str, choice: AlgorithmChoice | None) -> str:
    """'' when the codec compresses a bucket of ``dtype`` with ``choice``; else why not
    ('-' when the codec never applied: no codec, or a dtype it does not narrow)."""
    codec = inputs.codec
    if codec is None or not codec.applies_to(dtype_from_name(dtype)):
        return "-"
    if inputs.codec_scope == "inter" and (choice is None or choice.algorithm not in INTER_PHASE):
        algorithm = choice.algorithm if choice is not None else "flat"
        return f"codec_scope='inter': the bucket's {algorithm} all-reduce has no inter-host phase"
    return (inputs.codec_checks or {}).get(dtype, "")


def _codec_fact(inputs: DPPlanInputs, numel: int, wire: Codec | None) -> CodecFact | None:
    """The bucket's codec (None: uncompressed); a two-phase codec's error-feedback memory
    with it."""
    if wire is None:
        return None
    if not isinstance(wire, TwoPhaseCodec):
        return CodecFact(wire.name)
    if inputs.codec_scope == "inter":  # the 1/L shard, summed over the hosts
        hosts = len(inputs.group) // inputs.ranks_per_host
        residual = wire.residual_bytes(-(-numel // inputs.ranks_per_host), hosts)
    else:
        residual = wire.residual_bytes(numel, len(inputs.group))
    return CodecFact(wire.name, inputs.codec_scope, wire.error_feedback, residual)


def _codec_fallbacks(node_id: str, codec: Codec, failed: str) -> list[Fallback]:
    plan_time = Fallback(
        node_id,
        f"codec:{codec.name}",
        "uncompressed",
        "the codec fails its self-check while planning, or cannot apply to the bucket",
        taken=bool(failed),
        reason=failed,
    )
    if failed:
        return [plan_time]
    if isinstance(codec, TwoPhaseCodec):
        run_time = two_phase_fallback(node_id, codec)
    else:
        run_time = Fallback(
            node_id,
            f"codec:{codec.name}",
            "uncompressed",
            "the decoded reduction is not finite (overflow): resent uncompressed",
            when="run",
        )
    return [plan_time, run_time]


def _bucket_nodes(inputs: DPPlanInputs) -> tuple[list[PlanNode], list[Fallback]]:
    nodes, fallbacks = [], []
    for bucket in inputs.buckets.buckets:
        node_id = bucket_node(bucket.index)
        choice = (inputs.algorithms or {}).get(bucket.index)
        failed = _codec_applies(inputs, bucket.dtype, choice)
        wire = inputs.codec if not failed else None
        spec = CollectiveSpec(
            op="all_reduce",
            dtype=bucket.dtype,
            numel=bucket.numel,
            element_size=bucket.element_size,
            group=inputs.group,
            wire_dtype=dtype_name(wire.wire_dtype) if wire else None,
            wire_element_size=wire.wire_dtype.itemsize if wire else None,
            axis=inputs.axis,
        )
        names = bucket.param_names
        how = f", {choice.algorithm}" if choice is not None and choice.algorithm != "flat" else ""
        if isinstance(wire, TwoPhaseCodec):
            between = " between hosts" if inputs.codec_scope == "inter" else ""
            how += f", {wire.name} two-phase{between}"
        nodes.append(
            PlanNode(
                node_id,
                "collective",
                "backward",
                f"bucket {bucket.index}: {len(names)} gradient(s), {names[0]} .. {names[-1]}{how}",
                Collective(
                    "gradient",
                    bucket=bucket.index,
                    params=len(names),
                    algorithm=algorithm_fact(choice),
                    codec=_codec_fact(inputs, bucket.numel, wire),
                    slots=tuple(Slot(s.name, s.shape, s.offset) for s in bucket.slots),
                ),
                spec,
            )
        )
        if choice is not None and records_algorithm(choice):
            fallbacks.append(algorithm_fallback(node_id, choice))
        if inputs.codec is not None and failed != "-":
            fallbacks.extend(_codec_fallbacks(node_id, inputs.codec, failed))
    return nodes, fallbacks


def build_dp_plan(inputs: DPPlanInputs) -> ExecutionPlan:
    """The DAG of one DP step: buffer broadcast, forward, backward with one all-reduce per
    bucket (in gradient-ready order), the optimizer step; plus the wrap-time broadcast."""
    nodes: list[PlanNode] = []
    edges: list[tuple[str, str]] = []
    world = len(inputs.group)
    fallbacks = _capture_fallbacks(inputs.graph)
    if world > 1:
        nodes += broadcast_nodes("setup", inputs.setup_state, inputs.group, inputs.axis)
        for node in broadcast_nodes("forward", inputs.step_buffers, inputs.group, inputs.axis):
            nodes.append(node)
            edges.append((node.id, FORWARD))
    mode = f"compiled:{inputs.compile_backend}" if inputs.compile_backend else "eager"
    nodes.append(
        PlanNode(
            FORWARD,
            "forward",
            "forward",
            f"forward ({inputs.graph.method} graph, {len(inputs.graph.nodes)} nodes, {mode})",
            Compute(capture=inputs.graph.method, mode=mode),
        )
    )
    if inputs.compile_backend:
        fallbacks.append(
            Fallback(
                FORWARD,
                f"compiled:{inputs.compile_backend}",
                "eager",
                "torch.compile raises while compiling or running the forward",
                when="run",
            )
        )
    nodes.append(PlanNode(BACKWARD, "backward", "backward", "backward (autograd)", Compute()))
    edges.append((FORWARD, BACKWARD))
    buckets, bucket_fallbacks = _bucket_nodes(inputs)
    fallbacks.extend(bucket_fallbacks)
    nodes.extend(buckets if world > 1 else [])
    if world > 1 and inputs.buckets.excluded:
        nodes.append(_excluded_node(inputs))
    nodes.append(
        PlanNode(OPTIMIZER, "optimizer", "step", "optimizer step (user's optimizer)", Compute())
    )
    for node in nodes:
        if node.phase == "backward" and node.collective is not None:
            edges += [(BACKWARD, node.id), (node.id, OPTIMIZER)]
    if world == 1:
        edges.append((BACKWARD, OPTIMIZER))
    plan_meta = meta_items(
        cap_bytes=inputs.buckets.cap_bytes,
        first_bucket_bytes=inputs.buckets.first_bucket_bytes,
        alignment_bytes=inputs.buckets.alignment_bytes,
        pg_backend=inputs.pg_backend,
        codec=inputs.codec.name if inputs.codec else "none",
        **error_feedback_meta(nodes),
        **({"cost_model": inputs.cost_model} if inputs.cost_model else {}),
    )
    return ExecutionPlan(
        strategy="dp",
        world_size=world,
        backend=inputs.backend,
        nodes=tuple(nodes),
        edges=tuple(edges),
        fallbacks=tuple(f for f in fallbacks if f.node in {n.id for n in nodes}),
        graph_fingerprint=inputs.graph.fingerprint,
        meta=plan_meta,
    )


def _excluded_node(inputs: DPPlanInputs) -> PlanNode:
    excluded = inputs.buckets.excluded
    numel = sum(math.prod(inputs.graph.param_shapes[n]) for n in excluded) + len(excluded)
    dtype = dtype_name(
        stray_dtype(
            [dtype_from_name(inputs.graph.param_dtypes[n].removeprefix("torch.")) for n in excluded]
        )
    )
    return PlanNode(
        EXCLUDED,
        "collective",
        "backward",
        f"all-reduce of the gradients of {len(excluded)} parameter(s) unused in the captured "
        "forward, with one used-flag each (every step: any rank may have used them)",
        Collective("unused", params=len(excluded), slots=_packed(inputs, excluded)),
        CollectiveSpec(
            "all_reduce",
            dtype,
            numel,
            dtype_from_name(dtype).itemsize,
            inputs.group,
            axis=inputs.axis,
        ),
    )


def _packed(inputs: DPPlanInputs, names: Sequence[str]) -> tuple[Slot, ...]:
    """``names`` packed one after another (the unused gradients' flat buffer)."""
    slots, offset = [], 0
    for name in names:
        shape = tuple(inputs.graph.param_shapes[name])
        slots.append(Slot(name, shape, offset))
        offset += math.prod(shape)
    return tuple(slots)


def bucket_plan_of(plan: ExecutionPlan, planned: BucketPlan) -> BucketPlan:
    """The buckets the reducer runs, read from ``plan``'s gradient nodes (their slots,
    dtype, padded size and op) and its unused-gradient node; ``planned`` gives only the
    parameters the planner chose them with (cap, alignment) and its notes. With one rank
    the plan has no collective: ``planned`` then (its buckets only lay the gradients out
    in memory)."""
    if plan.world_size == 1:
        return planned
    buckets: list[Bucket] = []
    excluded: tuple[str, ...] = ()
    for node in plan.collectives():
        detail, spec = node.detail, node.collective
        if not isinstance(detail, Collective) or spec is None:
            continue
        if detail.purpose == "unused":
            excluded = tuple(s.name for s in detail.slots)
        elif detail.purpose == "gradient" and detail.bucket is not None:
            slots = tuple(BucketSlot(s.name, s.shape, s.offset, s.numel) for s in detail.slots)
            buckets.append(
                Bucket(detail.bucket, spec.dtype, slots, spec.numel, spec.element_size, spec.op)
            )
    # the planner's parameters (cap, alignment) and notes describe how it chose them
    return replace(
        planned, buckets=tuple(sorted(buckets, key=lambda b: b.index)), excluded=excluded
    )


def graph_lines(graph: CapturedGraph) -> tuple[str, ...]:
    """The pre-flight manifest's ``graph`` category: the capture method, then one line per
    node (op, target, output shapes and dtypes: what the graph fingerprint hashes; node
    names and devices are left out)."""
    nodes = (
        f"#{i} {n.op} {n.target}: shapes={[list(s) for s in n.shapes]} dtypes={list(n.dtypes)}"
        for i, n in enumerate(graph.nodes)
    )
    return (f"captured by {graph.method}", *nodes)
