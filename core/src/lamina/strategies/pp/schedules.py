"""The pipeline schedules and which stages each rank holds under them.

``gpipe``, ``1f1b``: one stage per rank. ``interleaved1f1b``: ``virtual_stages`` per rank
in a loop (rank ``r`` holds ``r, r + pp, ...``). ``zbv`` (zero bubble, V shape): two stages
per rank, rank ``r`` holding ``r`` and ``2 pp - 1 - r``, so the first and last stages sit
on rank 0. Each runs on torch's own ``torch.distributed.pipelining`` schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from lamina.errors import ConfigError


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule: torch's class, stages per rank, and the placement of stages."""

    name: str
    torch_class: type
    multi: bool  # torch's multi-stage schedule API (a list of stages)
    style: str  # "loop" or "v"
    fixed_virtual: int | None  # stages per rank it requires (None: the option decides)

    def stages_per_rank(self, virtual_stages: int) -> int:
        return self.fixed_virtual if self.fixed_virtual is not None else virtual_stages

    def stages_of_rank(self, rank: int, pp: int, virtual_stages: int) -> tuple[int, ...]:
        """Stage indices held by pipeline rank ``rank`` of ``pp``."""
        per = self.stages_per_rank(virtual_stages)
        if self.style == "v":
            return (rank, 2 * pp - 1 - rank)
        return tuple(rank + k * pp for k in range(per))

    def rank_of_stage(self, stage: int, pp: int) -> int:
        """The pipeline rank holding ``stage``."""
        if self.style == "v":
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind("gpipe", ScheduleGPipe, False, "loop", 1),
    "1f1b": ScheduleKind("1f1b", Schedule1F1B, False, "loop", 1),
    "interleaved1f1b": ScheduleKind("interleaved1f1b", ScheduleInterleaved1F1B, True, "loop", None),
    "zbv": ScheduleKind("zbv", ScheduleZBVZeroBubble, True, "v", 2),
}


def schedule_kind(name: str) -> ScheduleKind:
    """The schedule called ``name`` (case and ``-``/``_`` ignored); ConfigError otherwise."""
    key = name.lower().replace("-", "").replace("_", "")
    aliases = {"interleaved": "interleaved1f1b", "zerobubble": "zbv", "zbvzerobubble": "zbv"}
    key = aliases.get(key, key)
    if key not in SCHEDULES:
        raise ConfigError(
            f"strategy 'pp': unknown schedule {name!r}; use one of {sorted(SCHEDULES)}"
        )
    return SCHEDULES[key]


def bubble_fraction(kind: ScheduleKind, pp: int, microbatches: int, virtual: int) -> float:
    """The idle fraction of a step the schedule's formula predicts, with forward and
    backward of one stage taking equal time per microbatch and its backward twice its
    forward: ``(p - 1) / (v m + p - 1)``; zero bubble splits the backward so about a
    third of it fills the warm-up."""
    per = kind.stages_per_rank(virtual)
    bubble = (pp - 1) / (per * microbatches + pp - 1)
    if kind.name == "zbv":
        bubble /= 3
    return bubble
