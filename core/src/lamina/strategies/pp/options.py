"""The options ``lamina.distribute(model, "pp", ...)`` accepts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lamina.errors import ConfigError
from lamina.strategies.contract import StrategyOptions
from lamina.strategies.pp.cut import TIMED_RUNS
from lamina.strategies.pp.schedules import schedule_kind


@dataclass(frozen=True)
class PipelineOptions(StrategyOptions):
    """Pipeline options, validated on construction.

    ``example_inputs`` / ``example_kwargs``: one batch as ``model.step`` gets it; the
    chain of blocks is found, and each block timed, on one microbatch of it.
    ``microbatches``: how many the batch is split into (on dim 0). ``schedule``: ``gpipe``,
    ``1f1b``, ``interleaved1f1b`` or ``zbv``. ``virtual_stages``: stages per rank of the
    interleaved schedule (``zbv`` always holds 2). ``split_points``: the blocks that begin
    stages 1, 2, ... instead of the measured cut. ``timing_runs``: timed runs of each
    block (after a warm-up) whose median is its cost: more for a steadier cut on a noisy
    machine, 1 to plan fast.
    """

    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: dict[str, Any] | None = None
    microbatches: int = 4
    schedule: str = "1f1b"
    virtual_stages: int = 2
    split_points: Sequence[str] | None = None
    timing_runs: int = TIMED_RUNS

    def __post_init__(self) -> None:
        if self.example_inputs is None and self.example_kwargs is None:
            raise ConfigError(
                "strategy 'pp' finds its blocks and times them on one forward: pass "
                "example_inputs=(batch,) (and example_kwargs= if the forward takes keywords)"
            )
        if self.example_inputs is not None and not isinstance(self.example_inputs, tuple):
            raise ConfigError(
                f"example_inputs must be a tuple, got {type(self.example_inputs).__name__}; "
                "pass a single input as (x,)"
            )
        for name in ("microbatches", "virtual_stages", "timing_runs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        schedule_kind(self.schedule)  # a ConfigError naming the schedules
        if self.split_points is not None and (
            isinstance(self.split_points, str)
            or not all(isinstance(p, str) for p in self.split_points)
        ):
            raise ConfigError(
                f"split_points must be a list of block names, got {self.split_points!r}"
            )
