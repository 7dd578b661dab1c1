"""Sharding a model in place for ZeRO-3 (``lamina.distribute(model, "zero3")``) and, placed
on two mesh axes, HSDP: :func:`shard_module`.

The model keeps its parameters: :func:`shard_module` turns every trainable parameter
into a ``DTensor`` sharded on dim 0 over the shard group (replicated over the replica
group for HSDP) under its own name and shape, and returns the same module, its class
extended by :class:`~.module.ShardedModule`. So ``named_parameters()``, optimizer groups
built by name or shape, ``state_dict()`` and ``torch.distributed.checkpoint.state_dict``
work as with FSDP2. The local shards are views of each unit's flat shard buffer, which
the engine all-gathers and reduce-scatters (:mod:`lamina.memory.engine`). The layout and
unit order become an :class:`~lamina.runtime.ExecutionPlan` that every rank verifies
against the others before the first collective; the engine takes its settings from it.

The steps: the groups and the shard layout (:mod:`.groups`), the plan
(:mod:`.planning`), pre-flight and the wrap-time broadcast, the engine's settings read
from the plan (:mod:`.engine_settings`), the engine (:mod:`.engine_build`), and the
model's class extended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from lamina.errors import ConfigError
from lamina.memory import ShardLayout, build_layout, group_units
from lamina.runtime import RunLog
from lamina.strategies.coalesced import run_broadcast_nodes
from lamina.strategies.contract import Placement as MeshPlacement
from lamina.strategies.contract import PlannedStep
from lamina.strategies.preflight import before_first_collective
from lamina.strategies.zero3 import plan as plan_z3
from lamina.strategies.zero3.engine_build import (
    algorithm_groups,
    build_engine,
    dtensor_mesh,
    hook_units,
)
from lamina.strategies.zero3.engine_settings import engine_settings
from lamina.strategies.zero3.full_params import save_pretrained_method
from lamina.strategies.zero3.groups import shard_groups
from lamina.strategies.zero3.init_rng import register_shards
from lamina.strategies.zero3.materialize import on_meta
from lamina.strategies.zero3.module import ShardedModule, Sharding
from lamina.strategies.zero3.options import Zero3Options
from lamina.strategies.zero3.planning import plan_sharding, setup_tensors

if TYPE_CHECKING:
    from lamina.session import Runtime


def shard_module(
    module: nn.Module,
    runtime: Runtime,
    placement: MeshPlacement | None = None,
    options: Zero3Options | None = None,
    *,
    strategy: str = "zero3",
) -> ShardedModule:
    """Shard ``module`` in place (see the module docstring) and return it."""
    _check_unsharded(module)
    options = options or Zero3Options()
    placement = placement or MeshPlacement(shard=runtime.mesh.axis_names)
    # the groups and the layout
    groups = shard_groups(runtime, placement, strategy)
    layout = _layout(module, groups.world, options)
    # the plan, verified by every rank before the first collective
    planned = plan_sharding(module, layout, runtime, groups, options, strategy)
    plan = planned.plan
    step = PlannedStep(plan, (("shards", plan_z3.shard_lines(layout)),))
    preflight = before_first_collective(runtime, step, module, verify=options.verify)
    run_log = RunLog(plan)
    run_broadcast_nodes(run_log, "setup", setup_tensors(module), 0, None)
    sharding = Sharding(
        runtime, placement, layout, plan, run_log, preflight, groups.group, options.param_dtype
    )
    # the engine, as the plan says
    settings = engine_settings(plan)
    mesh = dtensor_mesh(runtime, placement)
    sharding.algorithm_groups = algorithm_groups(settings, planned.cost_model, groups.group)
    engine = build_engine(
        module,
        runtime,
        layout,
        groups,
        options,
        settings=settings,
        codec=planned.codec,
        mesh=mesh,
        hierarchical_groups=sharding.algorithm_groups,
        run_log=run_log,
    )
    sharding.engine = engine
    sharding.whole_forward = hook_units(module, engine)
    # the model, its class extended
    sharded = _extend_class(module, sharding, strategy)
    sharding.on_meta = on_meta(sharded)
    register_shards(engine.units)
    return sharded


def _check_unsharded(module: nn.Module) -> None:
    """ConfigError unless torch.distributed runs and ``module`` is not distributed yet."""
    if not dist.is_initialized():
        raise ConfigError("ZeRO-3 needs torch.distributed; call lamina.init() first")
    if isinstance(module, ShardedModule):
        raise ConfigError(
            f"this {type(module).__name__} is already sharded; distribute the model once"
        )
    if hasattr(type(module), "execution_plan") and hasattr(type(module), "step_summary"):
        raise ConfigError(
            f"this {type(module).__name__} is already distributed (it has an "
            "execution_plan); distribute the model once, with one strategy"
        )


def _layout(module: nn.Module, world: int, options: Zero3Options) -> ShardLayout:
    """The units of ``module`` and their row split over ``world`` shards."""
    return build_layout(
        module,
        world,
        alignment_bytes=options.alignment_bytes,
        units=group_units(module, min_unit_numel=options.min_unit_numel),
    )


def _extend_class(module: nn.Module, sharding: Sharding, strategy: str) -> ShardedModule:
    """``module`` itself, its class extended by :class:`ShardedModule`, carrying
    ``sharding``."""
    cls = type(module)
    methods = save_pretrained_method(cls, strategy)
    # the model's own name (Hugging Face writes type(model).__name__ into a saved
    # config's "architectures"); its __module__ says where the extension comes from
    extended = type(cls.__name__, (ShardedModule, cls), methods)
    extended.__qualname__ = cls.__qualname__
    module.__class__ = extended
    assert isinstance(module, ShardedModule)
    module.__dict__["lamina_sharding"] = sharding  # plain state: not a submodule or buffer
    return module
