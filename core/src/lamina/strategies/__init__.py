"""Parallel strategies: one folder each (``dp/``, ``zero3/``, ``hsdp/``) behind one contract.

:mod:`.contract` declares what a strategy is (name, options dataclass, placement on mesh
axes, ``plan`` and ``build``) and :mod:`.context` what it sees of the job;
:mod:`.registry` finds the built-ins and those plugins register; :mod:`.wrap_pipeline`
is the one sequence :func:`lamina.distribute` runs for every strategy (plan, stop or
verify, setup broadcast, build), with :mod:`.preflight`; :mod:`.coalesced`,
:mod:`.algorithm_choice` and the ``*_nodes`` modules are what strategies share.
"""

from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import (
    Placement,
    PlanAndBuild,
    PlannedStep,
    SetupBroadcast,
    StepInputs,
    Strategy,
    StrategyOptions,
)
from lamina.strategies.registry import get_strategy, strategies

__all__ = [
    "Placement",
    "PlanAndBuild",
    "PlannedStep",
    "SetupBroadcast",
    "StepInputs",
    "Strategy",
    "StrategyContext",
    "StrategyOptions",
    "get_strategy",
    "strategies",
]
