"""``lamina.distribute``: the one call that turns a model into a distributed one."""

from __future__ import annotations

from typing import Any

from torch import nn

from lamina.errors import ConfigError
from lamina.session import Runtime, current, init
from lamina.strategies.contract import Placement
from lamina.strategies.registry import get_strategy
from lamina.strategies.wrap_pipeline import distribute_with


def distribute(
    model: nn.Module,
    strategy: str = "dp",
    *,
    placement: Placement | None = None,
    runtime: Runtime | None = None,
    **options: Any,
) -> nn.Module:
    """Wrap ``model`` with ``strategy`` over the job ``runtime`` (default: the one
    :func:`lamina.init` joined, initialized here if needed).

    ``options`` are the strategy's (``lamina.strategies.strategies()[name].options``
    lists them; an unknown one is a ConfigError naming it and the valid ones).
    ``placement`` says which mesh axes it shards and replicates over (default: the
    strategy's own: ``dp`` replicates over every axis, ``zero3`` shards over every axis,
    ``hsdp`` shards over ``intra`` and replicates over ``inter``).
    """
    runtime = runtime or current() or init()
    if runtime.world_size != runtime.mesh.size():
        raise ConfigError(
            f"mesh {runtime.mesh} holds {runtime.mesh.size()} rank(s) but the job has "
            f"{runtime.world_size}; call lamina.init() with mesh='flat' or a mesh shape whose "
            "product is the world size"
        )
    chosen = get_strategy(strategy, runtime.plugins)
    settings = chosen.options.from_kwargs(chosen.name, options)
    where = placement if placement is not None else chosen.default_placement(runtime.mesh)
    where.check(runtime.mesh, chosen.name)
    return distribute_with(chosen, model, runtime, where, settings)
