"""Layer 4: the execution plan of one training step, its fallbacks and its run log.

A strategy builds an :class:`ExecutionPlan` before step 1 (``build_dp_plan``,
``build_zero3_plan``), each node's facts a typed dataclass (:mod:`lamina.runtime.nodes`);
its engine reads the collectives, primitives, algorithms, codecs and compute mode from the
plan's nodes and reports what it issued and every run-time
fallback to a :class:`RunLog`. :func:`explain` renders a plan for people.
"""

from lamina.runtime.log import FallbackEvent, RunLog
from lamina.runtime.nodes import (
    AlgorithmFact,
    CodecFact,
    Collective,
    Compute,
    Free,
    Gather,
    NodeDetail,
    Slot,
    Transfer,
    UnitFact,
)
from lamina.runtime.plan import CollectiveSpec, ExecutionPlan, Fallback, PlanNode
from lamina.runtime.render import explain

__all__ = [
    "AlgorithmFact",
    "CodecFact",
    "Collective",
    "CollectiveSpec",
    "Compute",
    "ExecutionPlan",
    "Fallback",
    "FallbackEvent",
    "Free",
    "Gather",
    "NodeDetail",
    "PlanNode",
    "RunLog",
    "Slot",
    "Transfer",
    "UnitFact",
    "explain",
]
