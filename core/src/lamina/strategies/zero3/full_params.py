"""The whole parameters of a sharded model for a block, and the methods that need them.

``model.full_parameters()`` (FSDP's ``summon_full_params``) gathers every unit in its
master dtype and gives each module plain, whole parameters, each with storage of its own
(so libraries that detect shared tensors by storage, as transformers' ``save_pretrained``
does, see the model's real ties only). Inside the block, forwards run on them without the
engine and without autograd; on exit the sharded parameters come back, after copying the
whole ones into the shards when asked (``writeback=True``).

A Hugging Face ``save_pretrained`` (transformers, peft) writes the whole model, so on a
sharded model it needs the block: called outside it, it raises one line saying so rather
than gathering by itself, because a call made on rank 0 alone would wait forever for the
other ranks' part of the gather.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.errors import ConfigError

if TYPE_CHECKING:
    from lamina.strategies.zero3.module import ShardedModule


@contextmanager
def summon_full_parameters(module: ShardedModule, writeback: bool) -> Iterator[None]:
    """See :meth:`ShardedModule.full_parameters`."""
    sharding = module.lamina_sharding
    engine = sharding.engine
    assert engine is not None
    if engine.summoned:
        raise ConfigError("full_parameters() is already open on this model; do not nest it")
    if sharding.on_meta:
        raise ConfigError(
            "the model is on the meta device; call model.to_empty(device=...) and "
            "initialize or load it before full_parameters()"
        )
    engine.drop_stale_prefetches()
    whole: dict[str, nn.Parameter] = {}
    for unit in engine.units:
        unsharded = unit.gather_master()
        for name, view in unit.layout.views(unsharded).items():
            param = unit.params[name]
            whole[name] = nn.Parameter(view.clone(), requires_grad=param.requires_grad)
        del unsharded
        for name, places in unit.places.items():
            for owner, attr in places:
                owner._parameters[attr] = whole[name]
    engine.summoned = True
    completed = False
    try:
        yield
        completed = True
    finally:
        engine.summoned = False
        for unit in engine.units:
            if writeback and completed:
                values = {name: whole[name].detach() for name in unit.layout.param_names}
                with torch.no_grad():
                    unit.layout.shard_of(values, unit.rank, out=unit.shard)
            engine.put_back(unit)


def full_parameters_forward(
    module: ShardedModule,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A forward inside ``full_parameters()``: the plain module on its whole parameters."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        raise ConfigError(
            "a forward with autograd inside full_parameters() would train copies that are "
            "dropped on exit; run it under torch.no_grad(), or leave the block to train"
        )
    return forward(*args, **kwargs)


def save_pretrained_method(cls: type[nn.Module], strategy: str) -> dict[str, Any]:
    """``{"save_pretrained": ...}`` for a class that has one (transformers, peft): it runs
    inside ``full_parameters()`` only, on every rank, with rank 0 writing unless the
    caller says otherwise (``is_main_process``); else ``{}``."""
    original = getattr(cls, "save_pretrained", None)
    if not callable(original):
        return {}
    try:
        takes_main = "is_main_process" in inspect.signature(original).parameters
    except (TypeError, ValueError):
        takes_main = False

    def save_pretrained(self: ShardedModule, *args: Any, **kwargs: Any) -> Any:
        engine = self.lamina_sharding.engine
        assert engine is not None
        if not engine.summoned:
            raise ConfigError(
                f"save_pretrained() of a {strategy}-sharded model needs the whole "
                "parameters: call it on every rank inside `with model.full_parameters():`"
            )
        if takes_main:
            kwargs.setdefault("is_main_process", dist.get_rank() == 0)
        return original(self, *args, **kwargs)

    save_pretrained.__doc__ = original.__doc__
    return {"save_pretrained": save_pretrained}
