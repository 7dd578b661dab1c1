"""Which global ranks form each pipeline, and where each stage of it runs
(:class:`PipelineLayout`): from the mesh, the pipeline axis and the schedule."""

from __future__ import annotations

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

    @classmethod
    def of(
        cls, mesh: torch.Tensor, axis_index: int, schedule: ScheduleKind, virtual: int, rank: int
    ) -> PipelineLayout:
        """From the mesh's rank array and the index of its pp axis."""
        moved = mesh.movedim(axis_index, -1).reshape(-1, mesh.shape[axis_index])
        pipelines = tuple(tuple(int(r) for r in row) for row in moved.tolist())
        return cls(pipelines, schedule, virtual, rank)

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
        """Global ranks holding the same stages as ``pipeline_rank`` (its data-parallel
        group across pipelines)."""
        return tuple(p[pipeline_rank] for p in self.pipelines)
