"""The Strategy contract: what a parallel strategy declares and how lamina calls it.

A strategy is one class (subclass :class:`Strategy`) in one folder of
``lamina/strategies/``, or in a plugin (hook ``lamina_register_strategies``). It declares

- its ``name`` (what ``lamina.distribute(model, name)`` selects) and a one-line
  ``summary``;
- ``options``: a frozen dataclass derived from :class:`StrategyOptions` whose fields are
  the keyword arguments the strategy accepts (``__post_init__`` validates them); an
  unknown or misspelt option is a :class:`~lamina.errors.ConfigError` naming it and
  listing the valid ones;
- :meth:`Strategy.default_placement`: which named axes of ``runtime.mesh`` it shards over
  and which it replicates over when the caller does not say (:class:`Placement`);
- :meth:`Strategy.wrap`: the wrapped model, given the runtime explicitly (never looked
  up). The wrapped model keeps torch's conventions and exposes ``execution_plan`` and
  ``step_summary()``; before its first collective it calls
  :func:`lamina.strategies.preflight.before_first_collective` with its plan and the
  manifest items it contributes to pre-flight verification (:class:`PlannedStep`), so
  that the verifier compares what the strategy knows without knowing strategies.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from torch import nn

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan

if TYPE_CHECKING:
    from lamina.session import Runtime

#: Manifest items a strategy contributes: (category, canonical lines) pairs.
ManifestItems = tuple[tuple[str, tuple[str, ...]], ...]

_O = TypeVar("_O", bound="StrategyOptions")


@dataclass(frozen=True)
class Placement:
    """The named mesh axes a strategy shards over and those it replicates over.

    Together they must name every axis of the mesh once: a data-parallel strategy
    replicates over all of them; ZeRO-3 shards over all of them; HSDP shards over the
    fast axis (``intra``) and replicates over the slow one (``inter``).
    """

    shard: tuple[str, ...] = ()
    replicate: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("shard", "replicate"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(a, str) for a in value):
                raise ConfigError(
                    f"Placement.{field} must be a tuple of mesh axis names, got {value!r}"
                )
            object.__setattr__(self, field, tuple(value))
        both = sorted(set(self.shard) & set(self.replicate))
        if both:
            raise ConfigError(
                f"Placement names axis {both[0]!r} both to shard and to replicate over; "
                "give each mesh axis one role"
            )

    def check(self, mesh: DeviceMesh, strategy: str) -> None:
        """ConfigError unless the axes are ``mesh``'s axes, each named once."""
        named = [*self.shard, *self.replicate]
        axes = list(mesh.axis_names)
        unknown = [a for a in named if a not in axes]
        missing = [a for a in axes if a not in named]
        if unknown or missing or len(set(named)) != len(named):
            what = f"unknown axis {unknown[0]!r}" if unknown else f"axis {missing[0]!r} unplaced"
            raise ConfigError(
                f"strategy {strategy!r}: placement {self.describe()} does not fit mesh axes "
                f"{axes} ({what}); name every mesh axis once in shard= or replicate=, or "
                "call lamina.init(mesh=...) with the axes the strategy needs"
            )

    def describe(self) -> str:
        """``shard=['intra'] replicate=['inter']``."""
        return f"shard={list(self.shard)} replicate={list(self.replicate)}"


@dataclass(frozen=True)
class StrategyOptions:
    """Base of every strategy's options: a frozen dataclass, validated on construction."""

    #: Run the pre-flight cross-rank check before the first collective.
    verify: bool = True

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names the strategy accepts."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls: type[_O], strategy: str, kwargs: Mapping[str, Any]) -> _O:
        """The options from keyword arguments; ConfigError naming an unknown one."""
        valid = cls.names()
        for name in kwargs:
            if name not in valid:
                raise ConfigError(
                    f"strategy {strategy!r} has no option {name!r}; its options are "
                    f"{', '.join(valid)}"
                )
        return cls(**kwargs)


@dataclass(frozen=True)
class PlannedStep:
    """What a strategy has planned before its first collective: the plan and the items
    it adds to this rank's pre-flight manifest (e.g. the captured graph, the shards)."""

    plan: ExecutionPlan
    manifest: ManifestItems = ()


class Strategy(abc.ABC):
    """One parallel strategy; see the module docstring for the contract."""

    #: What ``lamina.distribute(model, name)`` selects it by.
    name: ClassVar[str]
    #: One line for ``lamina info`` and error messages.
    summary: ClassVar[str]
    #: The options dataclass (fields = accepted keyword arguments).
    options: ClassVar[type[StrategyOptions]]

    @abc.abstractmethod
    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """Where the strategy goes on ``mesh`` when the caller gives no placement; a
        ConfigError naming the axes it needs when the mesh lacks them."""

    @abc.abstractmethod
    def wrap(
        self, model: nn.Module, runtime: Runtime, placement: Placement, options: StrategyOptions
    ) -> nn.Module:
        """The distributed model (a module with ``execution_plan`` and ``step_summary``)."""

    def describe(self) -> str:
        """``name: summary (options: a, b, c)``."""
        return f"{self.name}: {self.summary} (options: {', '.join(self.options.names())})"


def axis_names(mesh: DeviceMesh, wanted: Sequence[str], strategy: str) -> tuple[str, ...]:
    """``wanted`` if every name is an axis of ``mesh``; else a ConfigError that says how to
    build such a mesh."""
    missing = [a for a in wanted if a not in mesh.axis_names]
    if missing:
        raise ConfigError(
            f"strategy {strategy!r} needs mesh axes {list(wanted)} but the mesh has "
            f"{list(mesh.axis_names)}; call lamina.init(mesh='topology') (fast domains from "
            "the topology) or lamina.init(mesh=(shape, axes)), or pass placement="
        )
    return tuple(wanted)
