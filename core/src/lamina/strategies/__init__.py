"""Parallel strategies: one folder each (``dp/``, ``zero3/``, ``hsdp/``) behind one contract.

:mod:`.contract` declares what a strategy is (name, options dataclass, placement on mesh
axes, ``wrap``); :mod:`.registry` finds the built-ins and those plugins register;
:mod:`.preflight` and :mod:`.coalesced` are what every strategy shares. The entry point
is :func:`lamina.distribute`.
"""

from lamina.strategies.contract import Placement, PlannedStep, Strategy, StrategyOptions
from lamina.strategies.registry import get_strategy, strategies

__all__ = [
    "Placement",
    "PlannedStep",
    "Strategy",
    "StrategyOptions",
    "get_strategy",
    "strategies",
]
