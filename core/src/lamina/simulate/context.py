"""A context-parallel plan's step on the simulated cluster (:func:`predict_context`).

cp measures on the job before planning (the plan's meta, :mod:`lamina.runtime.render`):
a whole attention block's forward and backward, and this rank's forward + backward on its
own tokens. The step's compute is that local step plus the blocks cp adds (each rank's
queries against the other ranks' keys). Its all-gathers and all-to-alls are collectives
like any other (:mod:`lamina.simulate.timing`), not overlapped. Its pass-KV ring is
priced here: every rank sends at once, one ring step of the cp group's links each; a
forward step is hidden behind the attention of the block that arrived before (only what
exceeds it counts), a backward step of keys and values behind backward's attention, and
a step of their gradients not at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.runtime.nodes import Transfer
from lamina.runtime.plan import ExecutionPlan
from lamina.runtime.render import (
    BLOCK_BACKWARD,
    BLOCK_FORWARD,
    CONTEXT_AXIS,
    EXTRA_BLOCKS,
    LOCAL_STEP,
    RING_BLOCKS,
)
from lamina.simulate.groups import Groups


@dataclass(frozen=True)
class ContextPrediction:
    """A cp step's compute and its ring's exposed transfer time (seconds)."""

    axis: str
    compute_s: float
    ring_s: float
    ring_exposed_s: float

    def lines(self) -> list[str]:
        """The report's lines."""
        return [
            f"context parallel on {self.axis}: compute {self.compute_s * 1e3:.1f} ms "
            f"(measured local step + the blocks cp adds), pass-KV ring "
            f"{self.ring_s * 1e3:.1f} ms of which {self.ring_exposed_s * 1e3:.1f} ms exposed"
        ]

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds)."""
        return {
            "axis": self.axis,
            "compute_s": self.compute_s,
            "ring_s": self.ring_s,
            "ring_exposed_s": self.ring_exposed_s,
        }


def predict_context(plan: ExecutionPlan, groups: Groups) -> ContextPrediction | None:
    """The cp part of ``plan``'s step (see the module); None without cp."""
    meta = dict(plan.meta)
    axis = meta.get(CONTEXT_AXIS)
    if axis is None or LOCAL_STEP not in meta:
        return None
    forward, backward = float(meta[BLOCK_FORWARD]), float(meta[BLOCK_BACKWARD])
    compute = float(meta[LOCAL_STEP]) + float(meta[EXTRA_BLOCKS]) * (forward + backward)
    per_step = float(meta[RING_BLOCKS])
    group = groups.of(axis)
    ring = exposed = 0.0
    for node in plan.nodes:
        detail = node.detail
        if node.kind != "send" or not isinstance(detail, Transfer) or detail.axis != axis:
            continue
        step = group.ring_step(detail.nbytes * group.size)[0] if group.size > 1 else 0.0
        ring += step
        if detail.what == "gradient":
            exposed += step
        elif node.phase == "forward":
            exposed += max(0.0, step - per_step * forward)
        else:
            exposed += max(0.0, step - per_step * backward)
    return ContextPrediction(axis, compute, ring, exposed)


__all__ = ["ContextPrediction", "predict_context"]
