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
without a sharder the pipelines replicate over the axes left. Each strategy plans,
verifies across ranks and sets up as it does alone
(:func:`~lamina.strategies.wrap_pipeline.distribute_with`); the composed model's plan
holds every strategy's collectives and transfers, each on its axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.memory.engine import Zero3Engine
from lamina.memory.whole_step import WholeStepGather
from lamina.runtime import ExecutionPlan
from lamina.strategies.contract import Placement, Strategy, StrategyOptions
from lamina.strategies.extension import extend_class
from lamina.strategies.pp.module import PipelinedModule, Pipelining
from lamina.strategies.registry import get_strategy
from lamina.strategies.wrap_pipeline import DISTRIBUTED_WITH, distribute_with

if TYPE_CHECKING:
    from lamina.session import Runtime

#: The compositions lamina runs, as the user names them: a leading strategy, then the
#: strategies on the other axes.
COMPOSITIONS: tuple[tuple[str, ...], ...] = (
    ("tp", "zero3"),
    ("tp", "hsdp"),
    ("pp", "zero3"),
    ("pp", "hsdp"),
    ("pp", "tp"),
    ("pp", "tp", "zero3"),
)
#: The order they are applied in: ``tp`` splits the layers first (``pp`` cuts the split
#: model from one of its forwards, which needs the whole model), then ``pp`` prunes each
#: rank to its stages, then ``zero3`` / ``hsdp`` shards what is left.
APPLY_ORDER = ("tp", "pp", "zero3", "hsdp")
#: The strategies that shard parameters over the axes the others leave.
SHARDERS = ("zero3", "hsdp")
#: Plan node kinds an earlier strategy's plan adds to the composed one.
_CARRIED_KINDS = ("collective", "send", "recv")


class ComposedModule(nn.Module):
    """A model distributed by several strategies: one plan holding all their nodes."""

    lamina_composed: tuple[ExecutionPlan, ...]

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
    _check_order([s.name for s in chosen])
    named = {s.name for s in chosen}
    sharder = next((s for s in chosen if s.name in SHARDERS), None)
    if "pp" in named and sharder is not None:  # one gather per step serves every microbatch
        options = {"reshard_after_forward": False, **options}
    settings = _route_options(chosen, options)
    where = _placements(chosen, runtime.mesh, placement)
    held, plans, over = model, [], None
    for strategy in sorted(chosen, key=lambda s: APPLY_ORDER.index(s.name)):
        verify_group = None
        if strategy is sharder and "pp" in named:
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
    if sharder is not None and "tp" in named:
        _attach_views(held, runtime.mesh, where["tp"].shard[0], where[sharder.name])
    earlier = tuple(plans[:-1])
    if "pp" in named:
        _pipeline_over_splits(held)
        if sharder is not None:
            _gather_stages_per_step(held)
        held = extend_class(held, PipelinedComposedModule, {}, "lamina_composed", earlier)
    else:
        held = extend_class(held, ComposedModule, {}, "lamina_composed", earlier)
    held.__dict__[DISTRIBUTED_WITH] = "+".join(s.name for s in chosen)
    return held


class PipelinedComposedModule(ComposedModule):
    """A pipelined model whose stages a sharding strategy holds: the pipeline's own
    methods, which span every stage and shard, come before the sharded model's."""

    lamina_pp: Pipelining
    clip_grad_norm_ = PipelinedModule.clip_grad_norm_
    step_summary = PipelinedModule.step_summary


def _gather_stages_per_step(model: nn.Module) -> None:
    """The pipeline's steps gather the sharded stages once for all their microbatches."""
    pipelining, sharding = model.__dict__["lamina_pp"], model.__dict__["lamina_sharding"]
    assert isinstance(sharding.engine, Zero3Engine)
    pipelining.engine.sharding = WholeStepGather(sharding.engine)


def _attach_views(model: nn.Module, mesh: DeviceMesh, tp_axis: str, sharded: Placement) -> None:
    """Tensor parallelism's whole-tensor state-dict views placed beside the sharded
    strategy's mesh (collective: the combined meshes' groups)."""
    tp = model.__dict__.get("lamina_tp")
    sharded_mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if tp is None or sharded_mesh is None:
        return
    axes = tuple(a for a in mesh.axis_names if a in (*sharded.shard, *sharded.replicate))
    tp.views.attach(mesh.torch_mesh, tp_axis, sharded_mesh, axes)


def _pipeline_over_splits(model: nn.Module) -> None:
    """The pipeline's gradient norm counts each tensor-parallel slice once and each
    parameter the tp ranks replicate once (tp composed before ``pp``)."""
    tp = model.__dict__.get("lamina_tp")
    if tp is not None:
        engine = model.__dict__["lamina_pp"].engine
        engine.tensor_split = frozenset(tp.views.splits)
        engine.tensor_size = tp.group.size


def _check_order(names: list[str]) -> None:
    if tuple(names) not in COMPOSITIONS:
        listed = ", ".join(str(list(c)) for c in COMPOSITIONS)
        raise ConfigError(
            f"strategies {names} do not compose; compose a leading strategy with those on "
            f"the other mesh axes, in this order: {listed}"
        )


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
    """Each strategy's axes: as given, else ``pp`` and ``tp`` on their own axis and the
    sharder on the rest (``zero3`` shards them all; ``hsdp`` shards the innermost,
    replicates the others); with no sharder, ``pp`` replicates over the rest. Every mesh
    axis must be placed once."""
    given = dict(given or {})
    unknown = [n for n in given if n not in {s.name for s in chosen}]
    if unknown:
        raise ConfigError(f"placement names strategy {unknown[0]!r}, which is not composed here")
    sharder = next((s for s in chosen if s.name in SHARDERS), None)
    # a leading strategy takes its own axis only: the sharder syncs the others
    where = {
        s.name: given.get(s.name) or Placement(shard=s.default_placement(mesh).shard)
        for s in chosen
        if s is not sharder
    }
    used = {a for p in where.values() for a in (*p.shard, *p.replicate)}
    rest = tuple(a for a in mesh.axis_names if a not in used)
    if sharder is not None and not rest:
        raise ConfigError(
            f"strategies {list(where)} take every mesh axis {list(mesh.axis_names)}; give "
            f"{sharder.name!r} an axis: lamina.init(mesh={{'fsdp': N, 'tp': M}})"
        )
    if sharder is None:
        if rest and "pp" not in given:  # the pipelines replicate over the data axes
            where["pp"] = Placement(shard=where["pp"].shard, replicate=rest)
    elif sharder.name in given:
        where[sharder.name] = given[sharder.name]
    elif sharder.name == "hsdp" and len(rest) > 1:
        where[sharder.name] = Placement(shard=rest[-1:], replicate=rest[:-1])
    else:
        where[sharder.name] = Placement(shard=rest)
    named = [a for p in where.values() for a in (*p.shard, *p.replicate)]
    if sorted(named) != sorted(mesh.axis_names):
        described = {n: p.describe() for n, p in where.items()}
        raise ConfigError(
            f"placements {described} do not name every mesh axis {list(mesh.axis_names)} "
            "once; give each axis to one strategy"
        )
    return where
