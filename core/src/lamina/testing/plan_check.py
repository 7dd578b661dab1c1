"""What a step ran against what its plan says: :func:`collectives_against_plan`.

A model's run log (:class:`~lamina.runtime.RunLog`) counts every collective a step
issues under its plan node's id, and the bytes they moved (``StepRecord.issued``,
``StepRecord.nbytes``). A plan's forward and backward collectives are each issued once
per step (a forward and its backward), so comparing the two tells whether the engine ran
the plan: a planned collective never issued, one issued twice or unplanned, and bytes
moved other than the plan's sizes each come out as one readable line.

    record = model.run_log.current  # after loss.backward()
    assert not collectives_against_plan(model.execution_plan, record, prefix="tp.")
"""

from __future__ import annotations

from collections.abc import Iterable

from lamina.runtime import ExecutionPlan, PlanNode
from lamina.runtime.log import StepRecord

__all__ = ["collectives_against_plan", "describe_node"]

#: The phases whose collectives run in every step (the others: ``setup``, once).
STEP_PHASES: tuple[str, ...] = ("forward", "backward")


def describe_node(node: PlanNode) -> str:
    """``tp.blocks.0.attn.proj.fwd (forward reduce_scatter on tp, 4096 B)``."""
    spec = node.collective
    if spec is None:
        return f"{node.id} ({node.phase} {node.kind})"
    return f"{node.id} ({node.phase} {spec.op} on {spec.axis}, {spec.nbytes} B)"


def collectives_against_plan(
    plan: ExecutionPlan,
    record: StepRecord,
    *,
    prefix: str = "",
    phases: Iterable[str] = STEP_PHASES,
    passes: int = 1,
    rank: int | None = None,
) -> list[str]:
    """The differences between the collectives ``record`` holds and the collective nodes
    of ``plan`` in ``phases`` whose ids start with ``prefix`` (``"tp."``: one strategy's
    nodes of a composed plan), each expected ``passes`` times (forward and backward
    passes the record holds), as readable lines; empty when the step ran the plan.

    Per node: its count, and its op, mesh axis and bytes as the plan gives them (the run
    log records each issue under the node, so these are the node's). Bytes: the record's
    total against the plan's sizes of what it issued (an op that moved another size than
    its node says). A node whose group is one rank is not expected: it moves nothing.
    With ``rank``, only the nodes whose group holds that global rank (a pipeline's plan
    lists every pipeline rank's collectives; each rank runs its own)."""
    wanted = set(phases)
    planned = [  # a collective over one rank moves nothing: engines skip it
        n
        for n in plan.collectives()
        if n.phase in wanted
        and n.id.startswith(prefix)
        and n.collective is not None
        and len(n.collective.group) > 1
        and (rank is None or rank in n.collective.group)
    ]
    planned_ids = {n.id for n in planned}
    lines = []
    for node in planned:
        issued = record.issued.get(node.id, 0)
        if issued != passes:
            lines.append(f"{describe_node(node)}: planned {passes}x, issued {issued}x")
    known = {n.id: n for n in plan.nodes}
    for node_id, issued in sorted(record.issued.items()):
        if node_id in planned_ids or not node_id.startswith(prefix):
            continue
        other = known.get(node_id)
        why = "not a node of the plan" if other is None else f"a {other.phase} node of the plan"
        lines.append(f"{node_id}: issued {issued}x in the step, {why}")
    sized = [
        (known[i], count)
        for i, count in record.issued.items()
        if i in known and known[i].collective is not None
    ]
    if len(sized) == len(record.issued):
        expected = sum(count * node.collective.nbytes for node, count in sized if node.collective)
        if expected != record.nbytes:
            lines.append(
                f"bytes: the step moved {record.nbytes} B, its plan nodes say {expected} B "
                f"for the same {sum(record.issued.values())} collectives"
            )
    return lines
