"""The options ``lamina.distribute(model, "tp", ...)`` accepts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor.parallel import ParallelStyle

from lamina.errors import ConfigError
from lamina.strategies.contract import StrategyOptions


@dataclass(frozen=True)
class TensorParallelOptions(StrategyOptions):
    """Tensor-parallel options, validated on construction.

    The plan is derived from one forward on ``example_inputs`` / ``example_kwargs`` (a
    batch as the training loop feeds it), run once on every rank before any collective.
    ``sequence_parallel`` (default on) splits the activations between regions on the
    sequence (dim 1), so norms and dropout run on ``1/tp`` of the tokens. ``plan`` gives
    the split instead, as torch's ``ParallelStyle`` objects by module name (a torchtitan
    plan unchanged; :mod:`lamina.strategies.tp.given`): its ``SequenceParallel``
    entries then decide sequence parallelism.
    """

    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: dict[str, Any] | None = None
    sequence_parallel: bool = True
    plan: Mapping[str, ParallelStyle] | None = None

    def __post_init__(self) -> None:
        if self.example_inputs is None and self.example_kwargs is None:
            raise ConfigError(
                "strategy 'tp' derives its plan from one forward: pass example_inputs=(batch,) "
                "(and example_kwargs= if the forward takes keywords)"
            )
        if self.example_inputs is not None and not isinstance(self.example_inputs, tuple):
            raise ConfigError(
                f"example_inputs must be a tuple, got {type(self.example_inputs).__name__}; "
                "pass a single input as (x,)"
            )
        if self.plan is not None and not isinstance(self.plan, Mapping):
            raise ConfigError(
                f"plan must map module names to torch ParallelStyle objects, got "
                f"{type(self.plan).__name__}"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(
                f"sequence_parallel must be True or False, got {self.sequence_parallel!r}"
            )
