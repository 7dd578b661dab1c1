"""An expert-parallel plan's compute on the simulated cluster (:func:`predict_expert`).

ep measures on the job before planning (the plan's meta, :mod:`lamina.runtime.render`):
a rank's forward and backward of the whole model on its own batch, every rank at once.
Each token meets as many experts there as under ep, so that is the step's compute; its
exchanges (the per-layer count and token all-to-alls, sized from the measured routing,
and the gradient all-reduces) are collectives like any other
(:mod:`lamina.simulate.timing`), not overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.runtime.plan import ExecutionPlan
from lamina.runtime.render import EXPERT_AXIS, EXPERT_STEP


@dataclass(frozen=True)
class ExpertPrediction:
    """An ep step's compute (seconds)."""

    axis: str
    compute_s: float

    def lines(self) -> list[str]:
        """The report's lines."""
        return [
            f"expert parallel on {self.axis}: compute {self.compute_s * 1e3:.1f} ms "
            "(measured local step), then the exchanges and gradient collectives"
        ]

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds)."""
        return {"axis": self.axis, "compute_s": self.compute_s}


def predict_expert(plan: ExecutionPlan) -> ExpertPrediction | None:
    """The ep part of ``plan``'s step (see the module); None without a measured ep step."""
    meta = dict(plan.meta)
    axis = meta.get(EXPERT_AXIS)
    if axis is None or EXPERT_STEP not in meta:
        return None
    return ExpertPrediction(axis, float(meta[EXPERT_STEP]))


__all__ = ["ExpertPrediction", "predict_expert"]
