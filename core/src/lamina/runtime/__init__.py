"""Layer 4: the execution plan of one training step, its fallbacks and its run log.

A strategy builds an :class:`ExecutionPlan` before step 1 (``build_dp_plan``,
``build_zero3_plan``); its engine reads the collectives, primitives, codecs and
compute mode from the plan's nodes and reports what it issued and every run-time
fallback to a :class:`RunLog`. :func:`explain` renders a plan for people.
"""

from lamina.runtime.log import FallbackEvent, RunLog
from lamina.runtime.plan import CollectiveSpec, ExecutionPlan, Fallback, PlanNode
from lamina.runtime.render import explain

__all__ = [
    "CollectiveSpec",
    "ExecutionPlan",
    "Fallback",
    "FallbackEvent",
    "PlanNode",
    "RunLog",
    "explain",
]
