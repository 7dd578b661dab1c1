"""Planning a module's sharded step: :func:`plan_sharding`.

From the shard layout and the groups: the gradient codec, each unit's collective
algorithm (by the cost model of the shard group's links), the gather and reduce-scatter
primitives the process-group backend offers, and the unit order, into the
:class:`~lamina.runtime.ExecutionPlan` that every rank verifies before the first
collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lamina.comm.codecs import TwoPhaseCodec
from lamina.comm.cost import AlgorithmChoice, CostModel
from lamina.dtypes import dtype_name
from lamina.memory import ShardLayout
from lamina.runtime import ExecutionPlan
from lamina.runtime.primitives import PrimitiveChoice, choose_primitive, disabled_from_env
from lamina.strategies.algorithm_choice import choose_algorithms, group_cost_model
from lamina.strategies.coalesced import dtype_totals
from lamina.strategies.context import StrategyContext
from lamina.strategies.zero3 import plan as plan_z3
from lamina.strategies.zero3.groups import ShardGroups
from lamina.strategies.zero3.lookup import parameter, unit_submodule
from lamina.strategies.zero3.options import Zero3Options
from lamina.strategies.zero3.unit_codec import sharded_codec


@dataclass(frozen=True)
class PlannedSharding:
    """The plan of one sharded step, and the choices the engine builds on too."""

    plan: ExecutionPlan
    #: The cost model of the shard group's links (None for one rank).
    cost_model: CostModel | None
    #: The gradient codec (None: uncompressed).
    codec: TwoPhaseCodec | None
    #: What the plan was built from (rebuilt with the order the first forward records).
    inputs: plan_z3.Zero3PlanInputs


def plan_sharding(
    module: nn.Module,
    layout: ShardLayout,
    ctx: StrategyContext,
    groups: ShardGroups,
    options: Zero3Options,
    strategy: str,
) -> PlannedSharding:
    """The plan of ``module``'s sharded step over ``groups``, with ``layout``'s units."""
    codec = sharded_codec(options.codec, ctx.kernels)
    cost_model = group_cost_model(ctx.topology, groups.shard_ranks)
    choices = choose_algorithms(
        cost_model,
        {unit.name: unit.total_numel * unit.element_size for unit in layout.units},
        options.algorithm,
        pg_backend=str(dist.get_backend(groups.group)),
        # the hierarchical forms need the shard group to be the whole job in rank order
        # (slot r is rank r's shard)
        whole_job=groups.shard_ranks == tuple(range(dist.get_world_size())),
        sharded=True,
    )
    if codec is not None and not groups.replicas:
        choices = {}  # ZeRO-3's fp8 reduce-scatter runs over the flat shard group
    described = cost_model.describe() if cost_model is not None and choices else ""
    inputs = _plan_inputs(module, layout, ctx, groups, options, strategy, choices, described, codec)
    return PlannedSharding(plan_z3.build_zero3_plan(inputs), cost_model, codec, inputs)


def setup_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers the plan's wrap-time broadcast sends: those not on the
    meta device (a model built on meta has nothing to broadcast: its values come from
    ``to_empty`` and an initializer or load)."""
    return [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]


def _plan_inputs(
    module: nn.Module,
    layout: ShardLayout,
    ctx: StrategyContext,
    groups: ShardGroups,
    options: Zero3Options,
    strategy: str,
    algorithms: dict[str, AlgorithmChoice],
    cost_model: str,
    codec: TwoPhaseCodec | None = None,
) -> plan_z3.Zero3PlanInputs:
    pg_backend = str(dist.get_backend(groups.group))
    unsupported = ctx.backend.unsupported_collectives
    disabled = {*options.disable_collectives, *disabled_from_env()}

    def choice(op: str) -> PrimitiveChoice:
        return choose_primitive(
            op,
            pg_backend,
            mode=options.collectives,
            disable=disabled,
            unsupported=unsupported,
            group_size=len(groups.plan.shard),
        )

    whole = frozenset(u.name for u in layout.units if unit_submodule(module, u.name) is None)
    order = [u.name for u in layout.units if u.name in whole]
    order += [u.name for u in layout.units if u.name not in whole]
    param_dtype = options.param_dtype
    # backward starts with the last unit, and needs the whole-forward ones until its end
    kept = whole | {order[-1]} if order and options.reshard_after_forward else frozenset()
    return plan_z3.Zero3PlanInputs(
        layout=layout,
        forward_order=order,
        whole_forward=whole,
        groups=groups.plan,
        backend=ctx.backend.name,
        pg_backend=pg_backend,
        gather=choice("all_gather"),
        scatter=choice("reduce_scatter"),
        setup_state=dtype_totals(setup_tensors(module)),
        compute_dtype=dtype_name(param_dtype) if param_dtype else None,
        reshard_after_forward=options.reshard_after_forward,
        strategy=strategy,
        kept_for_backward=kept,
        algorithms=algorithms,
        cost_model=cost_model,
        codec=codec,
        frozen_units=_frozen_units(module, layout),
    )


def _frozen_units(module: nn.Module, layout: ShardLayout) -> frozenset[str]:
    """The units none of whose parameters requires grad."""
    return frozenset(
        unit.name
        for unit in layout.units
        if not any(parameter(module, p.name).requires_grad for p in unit.params)
    )
