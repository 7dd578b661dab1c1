"""What a plan issues in one step, read as the pricing reads it: for tests that check a
price against its plan."""

from __future__ import annotations

from lamina.runtime import ExecutionPlan
from lamina.runtime.nodes import Transfer
from lamina.simulate.timing import modelled_op


def issued(plan: ExecutionPlan) -> list[tuple[str, str, str, int]]:
    """Every collective and pipeline send one step of ``plan`` issues (id, op, axis,
    bytes), read from the plan as the engines read it."""
    out = []
    for node in plan.nodes:
        if node.collective is not None and node.phase != "setup":
            spec = node.collective
            out.append((node.id, modelled_op(node), spec.axis, spec.nbytes))
        elif node.kind == "send" and isinstance(node.detail, Transfer):
            out.append((node.id, "send", node.detail.axis, node.detail.nbytes))
    return sorted(out)
