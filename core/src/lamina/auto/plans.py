"""Each candidate's execution plan, made without a collective: :func:`plan_candidate`.

``"auto"`` prices a candidate from the plan its strategies would run
(:mod:`lamina.simulate.step`), so the plan is made as ``lamina.distribute`` makes it:
a copy of the model is distributed as the candidate says, inside
:func:`~lamina.strategies.preflight.planning_only` (no pre-flight check, no setup
broadcast), and a strategy that plans at its first forward is given one forward of the
example batch. The copy is dropped; the model, its RNG states and its buffers are
left as they were.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lamina.auto.candidates import Candidate
from lamina.auto.measure import batch_rows, rows_of
from lamina.errors import ConfigError
from lamina.graph.state import preserved
from lamina.runtime import ExecutionPlan
from lamina.simulate.step import is_stage
from lamina.strategies.compose import distribute_named
from lamina.strategies.preflight import planning_only

if TYPE_CHECKING:
    from lamina.auto.choose import Distribution
    from lamina.session import Runtime


@dataclass(frozen=True)
class CandidatePlan:
    """What a candidate runs: its plan, each composed strategy's own plan (earlier
    first: a pipeline's stages and schedule are in its own), and the parameters the
    busiest rank holds (what its optimizer steps)."""

    plan: ExecutionPlan
    parts: tuple[ExecutionPlan, ...]
    #: Parameter elements on the rank holding the most (its shard, split or stages).
    held_numel: int
    #: Whether those parameters are DTensors (each optimizer op dispatched through them).
    dtensors: bool

    @property
    def pipeline(self) -> ExecutionPlan | None:
        """The plan holding the pipeline's stages (None: not pipelined)."""
        for plan in (self.plan, *self.parts):
            if any(is_stage(n) for n in plan.nodes):
                return plan
        return None


def plan_candidate(
    model: nn.Module,
    candidate: Candidate,
    given: Distribution,
    runtime: Runtime,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    global_rows: int | None = None,
) -> CandidatePlan:
    """The execution plan ``candidate`` runs ``model`` with on ``runtime``'s mesh, its
    strategies applied as ``given`` says (every rank calls it at once, for the same
    candidates in the same order: the held parameters are the largest over the ranks);
    a ConfigError naming the candidate when its strategies refuse the model."""
    with preserved(model), planning_only():
        replica = copy.deepcopy(model)
        try:
            built = distribute_named(
                replica, given.strategy, runtime, given.placement, given.options
            )
            plan: ExecutionPlan | None = getattr(built, "execution_plan", None)
            if plan is None:  # planned at its first forward: one replica's rows
                rows = batch_rows(example_inputs)
                total = global_rows if global_rows is not None else rows * runtime.world_size
                inputs = rows_of(example_inputs, total // candidate.data_replicas, rows)
                with torch.no_grad():
                    built(*inputs, **(example_kwargs or {}))
                plan = getattr(built, "execution_plan", None)
            parts = tuple(built.__dict__.get("lamina_composed", ()))
            held, dtensors = _held(built)
        except ConfigError as refused:
            raise ConfigError(f"candidate {candidate.label}: {refused}") from refused
        finally:
            del replica
    if plan is None:
        raise ConfigError(
            f"candidate {candidate.label}: {given.strategy} made no plan on a forward of "
            "the example batch"
        )
    if runtime.world_size > 1:
        most = torch.tensor([held], dtype=torch.float64, device=runtime.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        held = int(most.item())
    return CandidatePlan(plan, parts, held, dtensors)


def _held(model: nn.Module) -> tuple[int, bool]:
    """Parameter elements this rank holds (a DTensor's local shard) and whether any is
    a DTensor."""
    held, dtensors = 0, False
    for p in model.parameters():
        if isinstance(p, DTensor):
            dtensors = True
            held += p.to_local().numel()
        else:
            held += p.numel()
    return held, dtensors


__all__ = ["CandidatePlan", "plan_candidate"]
