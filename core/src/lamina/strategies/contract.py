"""The Strategy contract: what a parallel strategy declares and how lamina calls it.

A strategy is one class (subclass :class:`Strategy`) in one folder of
``lamina/strategies/``, or in a plugin (hook ``lamina_register_strategies``). It declares

- its ``name`` (what ``lamina.distribute(model, name)`` selects) and a one-line
  ``summary``;
- ``options``: a frozen dataclass derived from :class:`StrategyOptions` whose fields are
  the keyword arguments the strategy accepts (``__post_init__`` validates them); an
  unknown or misspelt option is a :class:`~lamina.errors.ConfigError` naming it and
  listing the valid ones;
- :meth:`Strategy.default_placement`: which named axes of the mesh it shards over and
  which it replicates over when the caller does not say (:class:`Placement`);
- :meth:`Strategy.plan`: the step's :class:`~lamina.runtime.ExecutionPlan` and what the
  strategy adds to pre-flight verification, without a collective (:class:`PlannedStep`);
- :meth:`Strategy.build`: the distributed model from the planned step, after lamina has
  verified the plan across ranks and run the plan's setup broadcast.

Between the two, :func:`lamina.distribute` (:mod:`lamina.strategies.wrap_pipeline`)
stops for ``lamina plan`` / ``lamina verify``, runs pre-flight verification and the
setup broadcast, in one place for every strategy: a strategy never calls them. A
strategy that plans from a forward's inputs (``dp`` captures the graph at the first
forward that records gradients) says so with :meth:`Strategy.plans_at_first_forward` and
gets, in :meth:`Strategy.prepare` (the model as it runs before its plan exists), the
callable that runs the same sequence then. Strategies see the job through
:class:`~lamina.strategies.context.StrategyContext`. The distributed model keeps torch's
conventions and exposes ``execution_plan`` and ``step_summary()``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan, RunLog
from lamina.runtime.placement import AxisPlacement, Replicate, Role
from lamina.strategies.context import StrategyContext
from lamina.verify import PreflightReport

if TYPE_CHECKING:
    from lamina.strategies.compiled.in_graph import InGraphCollectives
    from lamina.strategies.compiled.step import LossFn, StepJob, StepOptions, TrainingStep

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
        for role in ("shard", "replicate"):
            value = getattr(self, role)
            if isinstance(value, str) or not all(isinstance(a, str) for a in value):
                raise ConfigError(
                    f"Placement.{role} must be a tuple of mesh axis names, got {value!r}"
                )
            object.__setattr__(self, role, tuple(value))
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
class StepInputs:
    """The inputs of the forward a strategy plans from (``dp``: the first one that records
    gradients, or ``example_inputs``)."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: What :meth:`Strategy.measure` timed on the job before planning (None: nothing).
    measured: Any = None


@dataclass(frozen=True)
class SetupBroadcast:
    """The plan's setup broadcast: ``tensors`` from global rank ``source`` over ``group``
    (None: the whole job), one collective per dtype as the plan's ``setup`` broadcast
    nodes say; run by :func:`lamina.distribute` after pre-flight."""

    tensors: tuple[torch.Tensor, ...]
    source: int = 0
    group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class PlannedStep:
    """What a strategy has planned before its first collective (:meth:`Strategy.plan`).

    ``module`` is the model being distributed, ``plan`` its step, ``manifest`` the items
    added to this rank's pre-flight manifest (the captured graph, the shards),
    ``leading_manifest`` items compared before the parameters (a pipeline's transfers,
    so that a mismatch names the send and its recv first),
    ``broadcast`` the setup broadcast to run (None: none), ``inputs`` what the strategy's
    :meth:`Strategy.build` needs beyond the plan (its own type, opaque to lamina).
    :func:`lamina.distribute` fills ``preflight`` (None when verification is off),
    ``run_log`` (the step's log, holding the setup broadcast) and ``verify_again`` before
    calling ``build``: where run-time facts fill the plan (ZeRO-3's unit order at the
    first forward), the strategy passes the filled plan to ``verify_again`` at a point
    every rank reaches, and every rank checks it against the others as pre-flight did
    (None when verification is off).
    """

    module: nn.Module
    plan: ExecutionPlan
    manifest: ManifestItems = ()
    broadcast: SetupBroadcast | None = None
    inputs: Any = None
    preflight: PreflightReport | None = None
    run_log: RunLog | None = None
    verify_again: Callable[[ExecutionPlan], PreflightReport] | None = None
    leading_manifest: ManifestItems = ()

    def log(self) -> RunLog:
        """The run log lamina made for this plan (a RuntimeError before it did)."""
        if self.run_log is None:
            raise RuntimeError("build() before lamina.distribute set the planned step up")
        return self.run_log


#: Plans, verifies, broadcasts and builds the step from a forward's inputs (given to a
#: strategy that plans at its first forward); returns the built model.
PlanAndBuild = Callable[[StepInputs], nn.Module]


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
    def plan(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        inputs: StepInputs | None = None,
    ) -> PlannedStep:
        """The planned step of ``model`` on ``placement``, without a collective (a
        ConfigError for a model or placement the strategy cannot take). ``inputs`` are
        the forward's, for a strategy that plans from them (None otherwise)."""

    @abc.abstractmethod
    def build(self, planned: PlannedStep) -> nn.Module:
        """The distributed model (a module with ``execution_plan`` and ``step_summary``)
        as ``planned`` says, verified and set up by lamina."""

    def measure(
        self, model: nn.Module, ctx: StrategyContext, placement: Placement, options: StrategyOptions
    ) -> Any:
        """What the strategy times on the job before it plans (collective: every rank
        runs it at once, right before :meth:`plan`); the result reaches :meth:`plan` as
        ``inputs.measured``, so planning itself issues no collective. Default: None,
        nothing measured."""
        return None

    def plans_at_first_forward(self, options: StrategyOptions) -> bool:
        """Whether the plan waits for a forward's inputs (default: no, planned at once)."""
        return False

    def prepare(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        plan_and_build: PlanAndBuild,
    ) -> nn.Module:
        """The model as it runs before its plan exists (called first, always; no
        collective). A strategy that :meth:`plans_at_first_forward` keeps
        ``plan_and_build`` and calls it with that forward's inputs. Default: ``model``
        unchanged."""
        return model

    #: What it does on the axes it shards over (:data:`~lamina.runtime.placement.ROLES`):
    #: ``split`` (cuts layers: tp), ``pipeline`` (stages: pp), ``shard`` (parameters
    #: sharded: zero3, hsdp) or ``replicate`` (whole copies: dp). Its replicate axes
    #: replicate. Composition orders strategies by it (:mod:`lamina.strategies.compose`).
    role: ClassVar[str] = "replicate"
    #: Roles of strategies applied before it whose model it can hold (composed after
    #: them): a sharder holds a split or pipelined model; by default, none.
    holds_after: ClassVar[frozenset[str]] = frozenset()
    #: Whether a sharder composed after it spans its axes too: it splits activations
    #: only and leaves every parameter whole there (``cp``).
    shares_axes: ClassVar[bool] = False
    #: Whether it composes beside another split on its own axis: it cuts parameters no
    #: other split cuts (``ep``: an MoE layer's stacked experts, which ``tp`` leaves
    #: whole), and is applied after that split.
    joins_split: ClassVar[bool] = False
    #: How a loop runs one step of a model it distributed, eagerly (what a refusal to
    #: compile the step says to run instead).
    eager_step: ClassVar[str] = "loss.backward(); optimizer.step()"

    def roles(self, placement: Placement) -> tuple[Role, ...]:
        """What it declares on ``placement``'s axes: :attr:`role` over the shard axes,
        ``replicate`` over the replicate axes. Batches differ across every axis but a
        split's or a pipeline's."""
        data = self.role not in ("split", "pipeline")
        declared = []
        if placement.shard:
            declared.append(Role(self.name, self.role, placement.shard, data=data))
        if placement.replicate:
            declared.append(Role(self.name, "replicate", placement.replicate, data=True))
        return tuple(declared)

    def place_parameters(
        self, model: nn.Module, placement: Placement
    ) -> Mapping[str, Mapping[str, AxisPlacement]]:
        """Parameters whose placement on its axes differs from its role's default
        (``split``: replicated; ``shard``: rows sharded, a 0-dim parameter replicated;
        ``replicate``: replicated; ``pipeline``: held by this rank's stage), by name:
        a split's cut tensors, a pipeline's tied weights. Default: the 0-dim parameters
        a sharder replicates."""
        if self.role != "shard":
            return {}
        return {
            name: {axis: Replicate() for axis in placement.shard}
            for name, p in model.named_parameters()
            if p.dim() == 0
        }

    def describe(self) -> str:
        """``name: summary (options: a, b, c)``."""
        return f"{self.name}: {self.summary} (options: {', '.join(self.options.names())})"

    def in_graph(self, model: nn.Module) -> InGraphCollectives | None:
        """Where this strategy's collectives run inside the model's forward and are
        captured with it (tensor parallelism's), what the compiled step of the strategy
        sharding the composed ``model`` needs of them; None (the default) where they are
        not (such a composition's step is not compiled)."""
        return None

    def compiled_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        settings: StepOptions,
        job: StepJob,
        inside: Sequence[InGraphCollectives] = (),
    ) -> TrainingStep:
        """``model``'s whole training step (forward, loss, backward, the plan's collectives,
        ``optimizer``'s update) as one captured graph: what ``lamina.compile_step`` returns
        for a model this strategy distributed (:mod:`lamina.strategies.compiled`), with
        ``inside`` the composed strategies whose collectives the forward issues
        (:meth:`in_graph`). Default: a one-line ConfigError naming the strategy and its
        :attr:`eager_step`; a strategy whose step compiles overrides it (``dp``,
        ``zero3``, ``hsdp``)."""
        raise ConfigError(
            f"compile_step does not take a model distributed with {self.name!r} yet; run its "
            f"step eagerly ({self.eager_step}), or distribute the model with 'dp', 'zero3' or "
            "'hsdp' (or compose a split such as 'tp' with 'zero3' or 'hsdp')"
        )


def named_axis_placement(mesh: DeviceMesh, axis: str, strategy: str) -> Placement:
    """The mesh axis named ``axis`` (a one-axis mesh: its axis), replicated over the
    others: where a strategy of its own axis (``cp``, ``ep``) goes by default; a
    ConfigError naming the mesh to build otherwise."""
    if axis in mesh.axis_names:
        rest = tuple(a for a in mesh.axis_names if a != axis)
        return Placement(shard=(axis,), replicate=rest)
    if len(mesh.axis_names) == 1:
        return Placement(shard=mesh.axis_names)
    raise ConfigError(
        f"strategy {strategy!r} needs a mesh axis named {axis!r} (the mesh has "
        f"{list(mesh.axis_names)}); call lamina.init(mesh={{'dp_shard': N, {axis!r}: M}})"
    )


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
