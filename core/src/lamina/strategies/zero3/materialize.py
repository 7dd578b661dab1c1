"""A sharded model changes device as a whole: ``to()``, ``to_empty()``, ``cuda()``.

The parameters of a model sharded by ``zero3`` / ``hsdp`` are ``DTensor``\\ s whose local
shards are views of their unit's flat shard buffer. torch's ``Module._apply`` would give
each parameter a tensor of its own, and leave the buffers the engine gathers behind (on
the meta device, for a model built there). Here the conversion is applied to each shard
buffer once, and each parameter, the same Python object (optimizers and user references
stay valid), becomes a view of the new buffer. ``to_empty`` thus allocates only this
rank's shards: ``1/N`` of the model plus each unit's padding and alignment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.memory.engine import UnitState
from lamina.memory.streams import comm_streams
from lamina.strategies.zero3.init_rng import register_shards

if TYPE_CHECKING:
    from lamina.strategies.zero3.module import ShardedModule

Convert = Callable[[torch.Tensor], torch.Tensor]


def on_meta(module: ShardedModule) -> bool:
    """Whether a shard buffer or a module buffer is still on the meta device."""
    engine = module.lamina_sharding.engine
    assert engine is not None
    return any(u.shard.is_meta for u in engine.units) or any(b.is_meta for b in module.buffers())


def move_shards(module: ShardedModule, fn: Convert, apply_rest: Callable[[], object]) -> None:
    """Apply ``fn`` (``Module._apply``'s conversion) to every shard buffer and rebuild the
    parameters as views of the results; ``apply_rest`` converts everything else (torch's
    own ``_apply``, run while the modules hold no sharded parameter)."""
    sharding = module.lamina_sharding
    engine = sharding.engine
    assert engine is not None
    if engine.summoned:
        raise ConfigError(
            "cannot move or convert the model inside full_parameters(); leave the block first"
        )
    engine.drop_stale_prefetches()
    held = [
        (owner, attr, owner._parameters[attr])
        for unit in engine.units
        for places in unit.places.values()
        for owner, attr in places
    ]
    for owner, attr, _param in held:
        owner._parameters[attr] = None
    try:
        apply_rest()
    finally:
        for owner, attr, param in held:
            owner._parameters[attr] = param
    strategy = sharding.execution_plan.strategy
    moved = [unit for unit in engine.units if _move_unit(unit, fn, strategy)]
    if moved:
        engine.streams = comm_streams(sharding.ctx.handle, moved[0].shard.device)
        register_shards(engine.units)
    sharding.on_meta = on_meta(module)


def _move_unit(unit: UnitState, fn: Convert, strategy: str) -> bool:
    """Convert ``unit``'s shard buffer; False when ``fn`` leaves it as it is."""
    old = unit.shard
    with torch.no_grad():
        new = fn(old)
    if new is old:
        return False
    if new.dtype != old.dtype:
        raise ConfigError(
            f"a {strategy} model keeps its shards in the dtype it was distributed with "
            f"({dtype_name(old.dtype)}); convert the model before lamina.distribute, or "
            "compute in another dtype with param_dtype="
        )
    unit.release()
    if old.is_meta:  # to_empty: padding and flag slots get defined values
        new.zero_()
    unit.shard = new
    for name, local in unit.layout.local_views(new, unit.rank).items():
        _rebind(unit.params[name], local, fn)
    return True


def _rebind(param: nn.Parameter, local: torch.Tensor, fn: Convert) -> None:
    """``param`` (the same object) becomes the DTensor of ``local``; its gradient, if it
    has one, is converted by ``fn``."""
    assert isinstance(param, DTensor)
    grad = param.grad
    if grad is not None:
        param.grad = None
    dtensor = DTensor(local, param._spec, requires_grad=param.requires_grad)  # type: ignore[no-untyped-call]
    replacement = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    replacement.__dict__.update(param.__dict__)  # attributes set on it (e.g. by transformers)
    torch.utils.swap_tensors(param, replacement)  # type: ignore[no-untyped-call]
    if isinstance(grad, DTensor):
        with torch.no_grad():
            moved = fn(grad._local_tensor)
        param.grad = DTensor(moved, grad._spec, requires_grad=False)  # type: ignore[no-untyped-call]
