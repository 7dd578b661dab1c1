"""Strategies composed on one mesh, each on its own axes: :func:`distribute_composed`.

``lamina.distribute(model, ["tp", "zero3"])``: ``tp`` splits the layers across its axis,
then ``zero3`` (or ``hsdp``) shards the split parameters' local tensors over the other
axes, as FSDP2 does for tensor-parallel parameters, broadcasting only over its own
groups. ``["pp", "zero3"]`` (or ``hsdp``) cuts the model into stages along ``pp``, then shards
each rank's stages over the other axes: a pipelined step gathers them once for all its
microbatches and reduce-scatters the summed gradients after the last
(:mod:`lamina.memory.whole_step`), and the sharder verifies its plan among the ranks
holding the same stages. ``["pp", "tp"]`` and ``["pp", "tp", "zero3"]`` (3-D) split each
stage's layers over ``tp`` too: ``tp`` is applied first, since the cut is found from a
forward of the whole (split) model, then ``pp``, then the sharder (:data:`APPLY_ORDER`);
without a sharder the pipelines replicate over the axes left.

Which strategies compose, and in which order, follows from the roles they declare
(:attr:`~lamina.strategies.contract.Strategy.role`, ``holds_after``; :func:`check_order`),
so a plugin's strategy composes by the same declaration. Each strategy plans, verifies
across ranks, sets up and places the model's parameters as it does alone
(:func:`~lamina.strategies.wrap_pipeline.distribute_with`), given what the earlier ones
placed (:mod:`lamina.runtime.placement`); a sharder that finds a pipeline there declares
the whole-step gather the pipeline's steps use. The composed model's plan holds every
strategy's collectives and transfers, each on its axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan
from lamina.runtime.placement import ModelPlacement
from lamina.strategies.contract import Placement, Strategy, StrategyOptions
from lamina.strategies.extension import extend_class
from lamina.strategies.pp.module import PipelinedModule, Pipelining
from lamina.strategies.registry import get_strategy
from lamina.strategies.surface import DistributedModule
from lamina.strategies.tp.state import GlobalViews
from lamina.strategies.wrap_pipeline import DISTRIBUTED_WITH, distribute_with

if TYPE_CHECKING:
    from lamina.session import Runtime

#: The order strategies are named in, by their declared role (outermost axis first, as
#: ``["pp", "tp", "zero3"]``): a pipeline, then a split, then a sharder or replicator.
NAMING_ORDER = ("pipeline", "split", "shard", "replicate")
#: The order they are applied in, by role: a split first (``pp`` cuts the split model
#: from one of its forwards, which needs the whole model), then the pipeline prunes each
#: rank to its stages, then a sharder shards what is left.
APPLY_ORDER = ("split", "pipeline", "shard", "replicate")
#: Plan node kinds an earlier strategy's plan adds to the composed one.
_CARRIED_KINDS = ("collective", "send", "recv")


class ComposedModule(DistributedModule):
    """A model distributed by several strategies: one plan holding all their nodes."""

    lamina_composed: tuple[ExecutionPlan, ...]

    def step_summary(self) -> str:
        """The last strategy's summary, after the lines of each earlier strategy whose
        model class offers ``composed_summary()`` (ep's layers and expert load)."""
        inner: str = super().step_summary()  # type: ignore[misc]
        if not self.lamina_composed:  # one strategy: its own summary
            return inner
        earlier = [
            cls.composed_summary(self)  # type: ignore[attr-defined]
            for cls in type(self).__mro__
            if "composed_summary" in cls.__dict__
        ]
        return "\n".join((*earlier, inner))

    @property
    def execution_plan(self) -> ExecutionPlan:
        """The last strategy's plan with the earlier ones' collectives added (their ids
        name the strategy: ``tp.blocks.0.attn.bwd``)."""
        inner: ExecutionPlan = super().execution_plan  # type: ignore[misc]
        extra = tuple(
            node
            if node.id.startswith(f"{plan.strategy}.")
            else replace(node, id=f"{plan.strategy}.{node.id}")
            for plan in self.lamina_composed
            for node in plan.nodes
            if node.kind in _CARRIED_KINDS
        )
        names = self.__dict__.get(DISTRIBUTED_WITH) or "+".join(
            (*(p.strategy for p in self.lamina_composed), inner.strategy)
        )
        metas = tuple(item for plan in self.lamina_composed for item in plan.meta)
        return replace(
            inner,
            strategy=names,
            nodes=(*extra, *inner.nodes),
            meta=(*metas, *inner.meta),
            _index={},  # built again for these nodes (the inner plan keeps its own)
        )


def distribute_composed(
    model: nn.Module,
    names: Sequence[str],
    runtime: Runtime,
    placement: Mapping[str, Placement] | None,
    options: Mapping[str, Any],
) -> nn.Module:
    """``model`` distributed by ``names`` (see the module)."""
    chosen = [get_strategy(n, runtime.plugins) for n in names]
    applied = check_order(chosen)
    roles = {s.role for s in chosen}
    sharder = next((s for s in chosen if s.role == "shard"), None)
    pipelined = "pipeline" in roles
    if pipelined and sharder is not None:  # one gather per step serves every microbatch
        options = {"reshard_after_forward": False, **options}
    settings = _route_options(chosen, options)
    if sharder is not None:  # the sharder spans a sharing strategy's axes and syncs there
        for strategy in chosen:
            if strategy.shares_axes and "sync_gradients" in strategy.options.names():
                settings[strategy.name] = replace(  # type: ignore[call-arg]
                    settings[strategy.name], sync_gradients=False
                )
    where = _placements(chosen, runtime.mesh, placement)
    _tell_data_axes(chosen, settings, where, runtime.mesh)
    held, plans, over = model, [], None
    for strategy in applied:
        verify_group = None
        if strategy is sharder and pipelined:
            # stages differ by design: the sharder's plans agree among one stage's ranks
            place = where[strategy.name]
            verify_group = runtime.mesh.group_over((*place.shard, *place.replicate))[0]
        held = distribute_with(
            strategy,
            held,
            runtime,
            where[strategy.name],
            settings[strategy.name],
            over=over,
            verify_group=verify_group,
        )
        plans.append(held.execution_plan)
        over = held.__dict__.get(DISTRIBUTED_WITH)
    for splitter in (s for s in chosen if s.role == "split" and not s.shares_axes):
        if sharder is not None:
            _attach_views(
                held,
                splitter.name,
                runtime.mesh,
                where[splitter.name].shard[0],
                where[sharder.name],
            )
    earlier = tuple(plans[:-1])
    if pipelined:
        held = extend_class(held, PipelinedComposedModule, {}, "lamina_composed", earlier)
    else:
        held = extend_class(held, ComposedModule, {}, "lamina_composed", earlier)
    held.__dict__[DISTRIBUTED_WITH] = "+".join(s.name for s in chosen)
    return held


class PipelinedComposedModule(ComposedModule):
    """A pipelined model whose stages a sharding strategy holds: the pipeline's own
    methods, which span every stage and shard, come before the sharded model's."""

    lamina_pp: Pipelining
    step_summary = PipelinedModule.step_summary


def _attach_views(
    model: nn.Module, strategy: str, mesh: DeviceMesh, axis: str, sharded: Placement
) -> None:
    """A split's whole-tensor state-dict views (tensor parallelism's layers, expert
    parallelism's experts: the state ``lamina_<strategy>`` holds) placed beside the
    sharded strategy's mesh (collective: the combined meshes' groups)."""
    state = model.__dict__.get(f"lamina_{strategy}")
    views = getattr(state, "views", None)
    sharded_mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if not isinstance(views, GlobalViews) or sharded_mesh is None:
        return
    axes = tuple(a for a in mesh.axis_names if a in (*sharded.shard, *sharded.replicate))
    views.attach(mesh.torch_mesh, axis, sharded_mesh, axes)


def check_order(chosen: Sequence[Strategy]) -> list[Strategy]:
    """``chosen`` in the order they are applied, by their declared roles: one strategy per
    role, named pipeline first, then split, then sharder; each applied after others must
    hold a model of their roles (:attr:`~lamina.strategies.contract.Strategy.holds_after`).
    A ConfigError in one line naming the fix otherwise."""
    names = [s.name for s in chosen]
    roles = [s.role for s in chosen]
    # a split that leaves every parameter whole (cp) shares the split role with one that
    # cuts them (tp): they split different things (tokens, layers) on their own axes
    counted = [s.role for s in chosen if not s.shares_axes and not s.joins_split]
    repeated = sorted({r for r in roles if counted.count(r) > 1 or roles.count(r) > 2})
    sharing = [s for s in chosen if s.shares_axes]
    if len(sharing) > 1:
        repeated = repeated or [sharing[0].role]
    if repeated:
        twice = [s.name for s in chosen if s.role == repeated[0]]
        raise ConfigError(
            f"strategies {names}: {twice} both {repeated[0]} the model; compose at most one "
            "strategy of each role (pipeline, split, shard or replicate; cp, which keeps "
            "parameters whole, and ep, which cuts the experts only, may join a split that "
            "cuts the layers)"
        )
    named = sorted(chosen, key=lambda s: NAMING_ORDER.index(s.role))
    if [s.name for s in named] != names:
        raise ConfigError(
            f"strategies {names} are named out of order; name the pipeline, then the split, "
            f"then the sharder: {[s.name for s in named]}"
        )
    # a sharing split after the split it shares with: tp's plan is derived from a whole
    # forward, cp then probes the split model (its heads as each rank holds them)
    applied = sorted(
        chosen, key=lambda s: (APPLY_ORDER.index(s.role), s.joins_split, s.shares_axes)
    )
    for at, strategy in enumerate(applied):
        earlier = [s for s in applied[:at] if s.role not in strategy.holds_after]
        if earlier:
            raise ConfigError(
                f"strategies {names} do not compose: {strategy.name!r} cannot hold a model "
                f"{earlier[0].name!r} has placed ({earlier[0].role}); "
                + _compose_hint(strategy, earlier[0])
            )
    return applied


def _compose_hint(strategy: Strategy, earlier: Strategy) -> str:
    """What to do instead, from what ``strategy`` declares it can hold."""
    if earlier.role == "pipeline" and strategy.role == "replicate":
        return (
            f"a pipeline replicates its stages over the mesh's other axes itself: distribute "
            f"with {earlier.name!r} alone on a mesh with those axes"
        )
    if not strategy.holds_after:
        return f"use {strategy.name!r} alone"
    roles = " or ".join(sorted(strategy.holds_after))
    return f"compose {strategy.name!r} only after a strategy whose role is {roles}, or alone"


def _tell_data_axes(
    chosen: list[Strategy],
    settings: dict[str, StrategyOptions],
    where: Mapping[str, Placement],
    mesh: DeviceMesh,
) -> None:
    """A strategy whose collectives span the job's data replicas (``ep``'s load-balancing
    loss; option ``data_axes``) is told their axes: those over which the composition's
    batches differ."""
    roles = tuple(r for s in chosen for r in s.roles(where[s.name]))
    data = ModelPlacement(tuple((a, mesh.size(a)) for a in mesh.axis_names), roles).data_axes
    for strategy in chosen:
        held = settings[strategy.name]
        if "data_axes" in strategy.options.names() and getattr(held, "data_axes", None) is None:
            settings[strategy.name] = replace(held, data_axes=data)  # type: ignore[call-arg]


def _route_options(
    chosen: list[Strategy], options: Mapping[str, Any]
) -> dict[str, StrategyOptions]:
    """Each keyword to every strategy that takes it; ConfigError for one none takes."""
    per: dict[str, dict[str, Any]] = {s.name: {} for s in chosen}
    for key, value in options.items():
        takers = [s for s in chosen if key in s.options.names()]
        if not takers:
            valid = sorted({n for s in chosen for n in s.options.names()})
            raise ConfigError(
                f"strategies {[s.name for s in chosen]} have no option {key!r}; their "
                f"options are {', '.join(valid)}"
            )
        for strategy in takers:
            per[strategy.name][key] = value
    return {s.name: s.options.from_kwargs(s.name, per[s.name]) for s in chosen}


def _placements(
    chosen: list[Strategy], mesh: DeviceMesh, given: Mapping[str, Placement] | None
) -> dict[str, Placement]:
    """Each strategy's axes: as given, else a pipeline (``pp``) and a split (``tp``) on
    their own axis and the sharder on the rest (``zero3`` shards them all; ``hsdp``
    shards the innermost, replicates the others); with no sharder, the pipeline
    replicates over the rest. Every mesh axis must be placed once."""
    given = dict(given or {})
    unknown = [n for n in given if n not in {s.name for s in chosen}]
    if unknown:
        raise ConfigError(f"placement names strategy {unknown[0]!r}, which is not composed here")
    sharder = next((s for s in chosen if s.role == "shard"), None)
    pipeline = next((s for s in chosen if s.role == "pipeline"), None)
    # a leading strategy takes its own axis only: the sharder syncs the others
    where = {
        s.name: given.get(s.name) or Placement(shard=s.default_placement(mesh).shard)
        for s in chosen
        if s is not sharder
    }
    used = {a for p in where.values() for a in (*p.shard, *p.replicate)}
    rest = tuple(a for a in mesh.axis_names if a not in used)
    # axes a sharder spans along with the strategy there (cp's: parameters whole on it)
    lent = {a for s in chosen if s.shares_axes and s.name in where for a in where[s.name].shard}
    spanned = tuple(a for a in mesh.axis_names if a in (*rest, *lent))
    if sharder is not None and not spanned:
        raise ConfigError(
            f"strategies {list(where)} take every mesh axis {list(mesh.axis_names)}; give "
            f"{sharder.name!r} an axis: lamina.init(mesh={{'fsdp': N, 'tp': M}})"
        )
    if sharder is None:
        if rest and pipeline is not None and pipeline.name not in given:
            # the pipelines replicate over the data axes
            where[pipeline.name] = Placement(shard=where[pipeline.name].shard, replicate=rest)
    elif sharder.name in given:
        where[sharder.name] = given[sharder.name]
    elif sharder.name == "hsdp" and len(spanned) > 1:
        where[sharder.name] = Placement(shard=spanned[-1:], replicate=spanned[:-1])
    else:
        where[sharder.name] = Placement(shard=spanned)
    named = [a for p in where.values() for a in (*p.shard, *p.replicate)]
    named = [a for i, a in enumerate(named) if a not in lent or a not in named[:i]]
    if sorted(named) != sorted(mesh.axis_names):
        described = {n: p.describe() for n, p in where.items()}
        raise ConfigError(
            f"placements {described} do not name every mesh axis {list(mesh.axis_names)} "
            "once; give each axis to one strategy"
        )
    return where


def distribute_named(
    model: nn.Module,
    strategy: str | Sequence[str],
    runtime: Runtime,
    placement: Placement | Mapping[str, Placement] | None,
    options: Mapping[str, Any],
) -> nn.Module:
    """``model`` distributed with the strategies named: one (on ``placement``, default
    its own) or a composition (``placement`` mapping names to axes). What
    ``lamina.distribute`` runs for strategies given by hand and for ``"auto"``'s choice,
    and what ``"auto"`` plans each candidate with."""
    if not isinstance(strategy, str):
        given = placement if isinstance(placement, Mapping) else None
        return distribute_composed(model, list(strategy), runtime, given, options)
    if isinstance(placement, Mapping):
        raise ConfigError(
            "placement= maps strategy names to axes only when strategies compose; pass a "
            "Placement for one strategy"
        )
    chosen = get_strategy(strategy, runtime.plugins)
    settings = chosen.options.from_kwargs(chosen.name, options)
    where = placement if placement is not None else chosen.default_placement(runtime.mesh)
    where.check(runtime.mesh, chosen.name)
    return distribute_with(chosen, model, runtime, where, settings)
