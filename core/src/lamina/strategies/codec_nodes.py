"""What a gradient codec adds to a plan, shared by the strategies: the run-time fallback
of a compressed collective and the plan's error-feedback memory."""

from __future__ import annotations

from collections.abc import Iterable

from lamina.comm.codecs import TwoPhaseCodec
from lamina.runtime.plan import Fallback, PlanNode


def two_phase_fallback(node_id: str, codec: TwoPhaseCodec) -> Fallback:
    """The run-time fallback of ``node_id``'s two-phase collective to ``codec.fallback``."""
    return Fallback(
        node_id,
        f"codec:{codec.name}",
        codec.fallback,
        f"the {codec.name} result is not finite: a rank's input is not finite, passes "
        "overflow_at or quantizes past error_bound (it sends a NaN every rank of the group "
        "decodes)",
        when="run",
    )


def error_feedback_meta(nodes: Iterable[PlanNode]) -> dict[str, object]:
    """The plan's error-feedback memory per rank (``residual_bytes`` of its nodes) as a
    plan attribute, when it has any."""
    total = sum(n.codec.residual_bytes for n in nodes if n.codec is not None)
    return {"error_feedback_bytes": total} if total else {}
