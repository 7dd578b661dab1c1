"""A readable rendering of an execution plan (``lamina plan --explain``)."""

from __future__ import annotations

from collections.abc import Sequence

from lamina.runtime.log import RunLog
from lamina.runtime.plan import ExecutionPlan
from lamina.units import format_bytes

#: The ``meta`` key of a plan's per-layer plan (tensor parallelism's splits), one line each.
LAYER_PLAN = "layer_plan"
#: Meta keys of a context-parallel plan the simulator reads: the cp axis, what cp measured
#: (seconds: a whole attention block's forward and backward, this rank's local step) and
#: the blocks it adds per step over all calls and computes per ring step of one call.
CONTEXT_AXIS = "cp_axis"
BLOCK_FORWARD, BLOCK_BACKWARD = "cp_block_forward_s", "cp_block_backward_s"
LOCAL_STEP, EXTRA_BLOCKS, RING_BLOCKS = "cp_local_step_s", "cp_extra_blocks", "cp_ring_step_blocks"
#: Meta keys of an expert-parallel plan the simulator reads: the ep axis and what ep
#: measured (seconds: a rank's forward and backward on its own batch, every rank at once).
EXPERT_AXIS, EXPERT_STEP = "ep_axis", "ep_local_step_s"


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [
        indent + "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    ]


def explain(plan: ExecutionPlan, log: RunLog | None = None) -> str:
    """Header, nodes in execution order, the collective sequence with bytes, and every
    declared fallback with whether (and why) it was taken."""
    meta = ", ".join(f"{k}={v}" for k, v in plan.meta if k != LAYER_PLAN)
    lines = [
        f"execution plan: {plan.strategy} on {plan.backend}, {plan.world_size} rank(s), "
        f"{len(plan.nodes)} nodes, {len(plan.edges)} edges",
        f"  plan fingerprint  {plan.fingerprint[:16]}",
        f"  graph fingerprint {plan.graph_fingerprint[:16]}",
        f"  settings          {meta}",
    ]
    layer_plan = dict(plan.meta).get(LAYER_PLAN)
    if layer_plan:
        lines += ["", "layer plan", *(f"  {line}" for line in layer_plan.split("\n"))]
    lines += ["", "nodes (execution order)"]
    node_rows: list[tuple[str, ...]] = [("#", "node", "kind", "phase", "what")]
    for k, node_id in enumerate(plan.topological_order()):
        node = plan.node(node_id)
        node_rows.append((str(k), node.id, node.kind, node.phase, node.label))
    lines += _table(node_rows)
    collectives = plan.collectives()
    per_step = [n for n in collectives if n.phase != "setup"]
    lines += [
        "",
        f"collective sequence ({len(per_step)} per step, "
        f"{format_bytes(sum(n.collective.nbytes for n in per_step if n.collective))} per step; "
        f"{len(collectives) - len(per_step)} at setup)",
    ]
    seq_rows = [("seq", "node", "op", "dtype", "elements", "bytes", "group")]
    for k, node in enumerate(collectives):
        spec = node.collective
        assert spec is not None
        dtype = spec.dtype + (f"->{spec.wire_dtype}" if spec.wire_dtype else "")
        seq_rows.append(
            (
                str(k),
                node.id,
                spec.op,
                dtype,
                str(spec.numel),
                format_bytes(spec.nbytes),
                f"{spec.axis} {list(spec.group)}",
            )
        )
    lines += _table(seq_rows) if collectives else ["  (none: one rank)"]
    lines += _algorithm_lines(plan)
    lines += _codec_lines(plan)
    lines += ["", "fallbacks (declared on the plan; identical ones on several nodes grouped)"]
    if plan.fallbacks:
        groups: dict[tuple[str, ...], list[str]] = {}
        for fb in plan.fallbacks:
            status = f"TAKEN: {fb.reason}" if fb.taken else "not taken"
            key = (f"{fb.primary} -> {fb.alternative}", fb.when, fb.condition, status)
            groups.setdefault(key, []).append(fb.node)
        rows: list[tuple[str, ...]] = [
            ("node", "primary -> alternative", "decided", "condition", "status")
        ]
        for group_key, nodes in groups.items():
            where = nodes[0] if len(nodes) == 1 else f"{nodes[0]} (+{len(nodes) - 1} more)"
            rows.append((where, *group_key))
        lines += _table(rows)
    else:
        lines.append("  (none declared)")
    if log is not None:
        lines += ["", "run-time fallbacks taken"]
        lines += [
            f"  step {e.step}  {e.node}  {e.primary} -> {e.alternative}: {e.reason}"
            for e in log.events
        ] or ["  (none)"]
    return "\n".join(lines)


def _algorithm_lines(plan: ExecutionPlan) -> list[str]:
    """The algorithm of each collective that has one (DP buckets' all-reduces, ZeRO-3's
    gathers and reduce-scatters): the cost model's predicted time of every algorithm
    that can run, and the choice."""
    chosen = [(n, n.algorithm) for n in plan.collectives() if n.algorithm is not None]
    if not chosen:
        return []
    model = dict(plan.meta).get("cost_model", "")
    lines = ["", "collective algorithms (cost model" + (f": {model})" if model else ")")]
    rows: list[tuple[str, ...]] = [("node", "bytes", "chosen", "predicted per algorithm")]
    for node, algorithm in chosen:
        assert node.collective is not None
        nbytes = format_bytes(node.collective.nbytes)
        rows.append((node.id, nbytes, algorithm.describe(), algorithm.predicted()))
    return lines + _table(rows)


def _codec_lines(plan: ExecutionPlan) -> list[str]:
    """The compressed collectives: their codec, where it compresses and the error-feedback
    memory each holds (per rank)."""
    compressed = [(n, n.codec) for n in plan.collectives() if n.codec is not None]
    if not compressed:
        return []
    total = sum(codec.residual_bytes for _, codec in compressed)
    lines = ["", f"gradient codec (error feedback holds {format_bytes(total)} per rank)"]
    rows: list[tuple[str, ...]] = [("node", "codec", "scope", "error feedback", "residuals")]
    for node, codec in compressed:
        feedback = "on" if codec.error_feedback else "off"
        residual = format_bytes(codec.residual_bytes)
        rows.append((node.id, codec.name, codec.scope, feedback, residual))
    return lines + _table(rows)
