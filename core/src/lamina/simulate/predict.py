"""Predict a training step's communication time and per-rank memory on a declared cluster.

Input: an :class:`~lamina.runtime.ExecutionPlan` captured on a few local ranks (its
collective nodes: op, bytes, group axis; the strategy) and a
:class:`~lamina.simulate.cluster.Cluster`. Output: a
:class:`~lamina.simulate.report.StepPrediction` with every collective's time split by
phase and link class, the per-step totals, and the model state each rank holds.

The per-step total is the sum of the per-step collectives, one after the other: no
overlap with compute or between collectives (the real step hides part of it behind
backward; how much needs compute times, which this does not model). Collectives of the
``setup`` phase (the wrap-time broadcast) run once and are reported apart.
Tensor parallelism's activation collectives (one per layer collective, bytes from the
captured forward) are per-step collectives on the simulated mesh's ``tp`` group; the
report also lists them per layer. A pipelined plan's schedule (its stages' measured
compute, the transfers between them, its bubble) is simulated over the plan's
dependencies (:mod:`lamina.simulate.pipeline`) and comes before the gradient
collectives in the predicted step.

The parts: :mod:`lamina.simulate.groups` (the simulated group of each mesh axis),
:mod:`lamina.simulate.timing` (each collective's time), :mod:`lamina.simulate.memory`
(the ZeRO memory formulas), :mod:`lamina.simulate.report` (the prediction, its report
and assumptions); :func:`predict` wires them together.
"""

from __future__ import annotations

from lamina.runtime.nodes import Collective
from lamina.runtime.plan import ExecutionPlan
from lamina.simulate.cluster import Cluster
from lamina.simulate.context import predict_context
from lamina.simulate.expert import predict_expert
from lamina.simulate.groups import Groups, check_axes
from lamina.simulate.memory import ADAMW_BYTES_PER_PARAM, estimate_memory
from lamina.simulate.pipeline import predict_pipeline
from lamina.simulate.report import StepPrediction, assumptions
from lamina.simulate.timing import CollectiveTime, predict_collective, replica_all_reduce


def predict(
    plan: ExecutionPlan,
    cluster: Cluster,
    *,
    optimizer_bytes_per_param: float = ADAMW_BYTES_PER_PARAM,
) -> StepPrediction:
    """Predict ``plan``'s per-step communication and per-rank memory on ``cluster``."""
    check_axes(plan, cluster)
    groups = Groups(cluster)
    per_step: list[CollectiveTime] = []
    once: list[CollectiveTime] = []
    replicate_axis = plan.replicate_axis
    for node in plan.collectives():
        collective = node.facts(Collective)
        if replicate_axis and collective is not None and collective.purpose == "replicate":
            continue  # sized for the capture's shard group: derived again below
        timed = predict_collective(groups, node)
        (once if node.phase == "setup" else per_step).append(timed)
        if replicate_axis and node.scatters_gradient:
            per_step.append(replica_all_reduce(groups, node, replicate_axis))
    memory = estimate_memory(plan, cluster, groups, optimizer_bytes_per_param)
    return StepPrediction(
        cluster=cluster,
        strategy=plan.strategy,
        captured_world_size=plan.world_size,
        per_step=tuple(per_step),
        once=tuple(once),
        memory=memory,
        assumptions=assumptions(plan, cluster, optimizer_bytes_per_param, groups),
        groups=groups.described(),
        pipeline=predict_pipeline(plan, groups),
        context=predict_context(plan, groups),
        expert=predict_expert(plan),
    )


__all__ = ["predict"]
