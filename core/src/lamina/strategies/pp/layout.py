"""Which global ranks form each pipeline, and where each stage of it runs
(:class:`PipelineLayout`): from the mesh, the pipeline axis and the schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lamina.strategies.pp.schedules import ScheduleKind


@dataclass(frozen=True)
class PipelineLayout:
    """The pipelines of the job (global ranks, in pipeline order), this rank's one."""

    #: Every pipeline: the global ranks along the pp axis, one tuple per replica.
    pipelines: tuple[tuple[int, ...], ...]
    schedule: ScheduleKind
    virtual_stages: int
    rank: int

    #: The job's ranks partitioned into the groups that replicate one stage's state (the
    #: pp placement's replicate axes; one rank a group when it replicates over none).
    replica_sets: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(
        cls,
        mesh: torch.Tensor,
        axis_index: int,
        schedule: ScheduleKind,
        virtual: int,
        rank: int,
        replicate: Sequence[int] | None = None,
    ) -> PipelineLayout:
        """From the mesh's rank array, the index of its pp axis and of the axes the
        pipelines replicate over (None: every other axis)."""
        moved = mesh.movedim(axis_index, -1).reshape(-1, mesh.shape[axis_index])
        pipelines = tuple(tuple(int(r) for r in row) for row in moved.tolist())
        dims = range(mesh.dim())
        over = [d for d in dims if d != axis_index] if replicate is None else list(replicate)
        order = [d for d in dims if d not in over] + over
        width = math.prod(mesh.shape[d] for d in over)
        grouped = mesh.permute(*order).reshape(-1, width)
        sets = tuple(tuple(int(r) for r in row) for row in grouped.tolist())
        return cls(pipelines, schedule, virtual, rank, sets)

    @property
    def size(self) -> int:
        """Ranks per pipeline (the pp degree)."""
        return len(self.pipelines[0])

    @property
    def stage_count(self) -> int:
        """Stages of one pipeline."""
        return self.size * self.schedule.stages_per_rank(self.virtual_stages)

    @property
    def pipeline(self) -> tuple[int, ...]:
        """This rank's pipeline."""
        return next(p for p in self.pipelines if self.rank in p)

    @property
    def pipeline_rank(self) -> int:
        """This rank's position in its pipeline."""
        return self.pipeline.index(self.rank)

    def stages_of(self, pipeline_rank: int) -> tuple[int, ...]:
        """Stages held at ``pipeline_rank``."""
        return self.schedule.stages_of_rank(pipeline_rank, self.size, self.virtual_stages)

    def holder(self, stage: int) -> int:
        """Pipeline rank holding ``stage``."""
        return self.schedule.rank_of_stage(stage, self.size)

    def replicas_at(self, pipeline_rank: int) -> tuple[int, ...]:
        """Global ranks holding the same state as this pipeline's ``pipeline_rank``
        (its data-parallel group across pipelines), in mesh order."""
        rank = self.pipeline[pipeline_rank]
        return next(s for s in self.replica_sets if rank in s)
