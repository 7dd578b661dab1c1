"""Sharding a model in place for ZeRO-3 (``lamina.distribute(model, "zero3")``) and, placed
on two mesh axes, HSDP: :func:`plan_shards`, then :func:`build_sharded`.

The model keeps its parameters: :func:`build_sharded` turns every trainable parameter
into a ``DTensor`` sharded on dim 0 over the shard group (replicated over the replica
group for HSDP) under its own name and shape, and returns the same module, its class
extended by :class:`~.module.ShardedModule`. So ``named_parameters()``, optimizer groups
built by name or shape, ``state_dict()`` and ``torch.distributed.checkpoint.state_dict``
work as with FSDP2. The local shards are views of each unit's flat shard buffer, which
the engine all-gathers and reduce-scatters (:mod:`lamina.memory.engine`). The layout and
unit order become an :class:`~lamina.runtime.ExecutionPlan` that every rank verifies
against the others before the first collective; the engine takes its settings from it.

Two steps, with :func:`lamina.distribute`'s pre-flight and setup broadcast between them:
:func:`plan_shards` (the groups and the shard layout, :mod:`.groups`; the plan,
:mod:`.planning`) and :func:`build_sharded` (the engine's settings read from the plan,
:mod:`.engine_settings`; the engine, :mod:`.engine_build`; the model's class extended).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from lamina.graph.blocks import unit_blocks
from lamina.memory import ShardLayout, build_layout, group_units
from lamina.memory.whole_step import WholeStepGather
from lamina.runtime import ExecutionPlan
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import Placement as MeshPlacement
from lamina.strategies.contract import PlannedStep, SetupBroadcast
from lamina.strategies.extension import extend_class
from lamina.strategies.surface import PLACEMENT_KEY, STEP_SHARDING_KEY
from lamina.strategies.zero3 import plan as plan_z3
from lamina.strategies.zero3.engine_build import (
    algorithm_groups,
    build_engine,
    dtensor_mesh,
    hook_units,
)
from lamina.strategies.zero3.engine_settings import engine_settings, plan_layout
from lamina.strategies.zero3.full_params import save_pretrained_method
from lamina.strategies.zero3.groups import ShardGroups, shard_groups
from lamina.strategies.zero3.init_rng import register_shards
from lamina.strategies.zero3.materialize import on_meta
from lamina.strategies.zero3.module import ShardedModule, Sharding
from lamina.strategies.zero3.options import Zero3Options
from lamina.strategies.zero3.planning import PlannedSharding, plan_sharding, setup_tensors
from lamina.verify import PreflightReport


@dataclass(frozen=True)
class ShardingInputs:
    """What :func:`build_sharded` builds on besides the execution plan."""

    ctx: StrategyContext
    placement: MeshPlacement
    options: Zero3Options
    strategy: str
    groups: ShardGroups
    layout: ShardLayout
    planned: PlannedSharding


def plan_shards(
    module: nn.Module,
    ctx: StrategyContext,
    placement: MeshPlacement,
    options: Zero3Options,
    strategy: str,
) -> PlannedStep:
    """The sharded step of ``module`` over ``placement``'s groups; no collective."""
    groups = shard_groups(ctx, placement, strategy)
    layout = _layout(module, groups.world, options)
    planned = plan_sharding(module, layout, ctx, groups, options, strategy)
    return PlannedStep(
        module,
        planned.plan,
        (("shards", plan_z3.shard_lines(layout)),),
        SetupBroadcast(
            tuple(setup_tensors(module)), groups.plan.everyone[0], groups.everyone_group
        ),
        ShardingInputs(ctx, placement, options, strategy, groups, layout, planned),
    )


def build_sharded(step: PlannedStep) -> ShardedModule:
    """``step.module`` sharded in place, as the verified plan says (see the module)."""
    inputs = step.inputs
    assert isinstance(inputs, ShardingInputs)
    module, plan, groups, options = step.module, step.plan, inputs.groups, inputs.options
    run_log = step.log()
    layout = plan_layout(plan, inputs.layout)  # the plan's units: what every rank verified
    sharding = Sharding(
        inputs.ctx,
        inputs.placement,
        layout,
        plan,
        run_log,
        step.preflight,
        groups.group,
        options.param_dtype,
    )
    # the engine, as the plan says
    settings = engine_settings(plan)
    mesh = dtensor_mesh(inputs.ctx, inputs.placement)
    sharding.algorithm_groups = algorithm_groups(settings, inputs.planned.cost_model, groups.group)
    engine = build_engine(
        module,
        inputs.ctx,
        layout,
        groups,
        options,
        settings=settings,
        codec=inputs.planned.codec,
        mesh=mesh,
        hierarchical_groups=sharding.algorithm_groups,
        run_log=run_log,
    )
    engine.set_planned_order(settings.forward_order)
    engine.on_order_recorded = lambda order: record_forward_order(
        sharding, inputs.planned, order, step.verify_again
    )
    sharding.engine = engine
    sharding.whole_forward = hook_units(module, engine)
    # the model, its class extended
    sharded = _extend_class(module, sharding, inputs.strategy)
    sharding.on_meta = on_meta(sharded)
    register_shards(engine.units)
    held = sharded.__dict__.get(PLACEMENT_KEY)
    if held is not None and any(r.role == "pipeline" for r in held.roles):
        # a pipeline's step gathers the stages once for all of its microbatches
        sharded.__dict__[STEP_SHARDING_KEY] = WholeStepGather(engine)
    return sharded


def record_forward_order(
    sharding: Sharding,
    planned: PlannedSharding,
    entered: tuple[str, ...],
    verify_again: Callable[[ExecutionPlan], PreflightReport] | None,
) -> None:
    """The plan, rebuilt with the unit order the first forward ``entered`` (units it never
    entered keep their planned place after those), becomes the model's plan and the run
    log's: what the simulator and ``lamina plan`` read from then on. Node ids, sizes and
    keep/free decisions stay the engine's; only the order (and the plan's
    ``forward_order`` fact) moves. With verification on, every rank (each ends its first
    forward here) checks the recorded plan against the others': a forward that entered
    the units in another order on some rank is a VerificationError naming it."""
    planned_order = list(planned.inputs.forward_order)
    order = [*entered, *(u for u in planned_order if u not in entered)]
    inputs = replace(planned.inputs, forward_order=order, order_source="recorded at step 1")
    plan = plan_z3.build_zero3_plan(inputs)
    # what was recorded in the planned plan's meta beside the engine (``auto``'s choice)
    rebuilt = dict(plan.meta)
    carried = [(k, v) for k, v in sharding.execution_plan.meta if k not in rebuilt]
    if carried:
        plan = replace(plan, meta=tuple(sorted((*plan.meta, *carried))))
    sharding.execution_plan = plan
    sharding.run_log.plan = plan
    if verify_again is not None:
        sharding.preflight = verify_again(plan)


def _layout(module: nn.Module, world: int, options: Zero3Options) -> ShardLayout:
    """The units of ``module`` and their row split over ``world`` shards."""
    return build_layout(
        module,
        world,
        alignment_bytes=options.alignment_bytes,
        units=group_units(
            module, min_unit_numel=options.min_unit_numel, blocks=unit_blocks(module)
        ),
    )


def _extend_class(module: nn.Module, sharding: Sharding, strategy: str) -> ShardedModule:
    """``module`` itself, its class extended by :class:`ShardedModule`, carrying
    ``sharding``."""
    methods = save_pretrained_method(type(module), strategy)
    return extend_class(module, ShardedModule, methods, "lamina_sharding", sharding)
