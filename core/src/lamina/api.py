"""``lamina.distribute``: the one call that turns a model into a distributed one."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lamina.errors import ConfigError
from lamina.session import Runtime, current, init
from lamina.strategies.compiled.step import CompiledStep, StepJob, StepOptions
from lamina.strategies.compose import distribute_composed
from lamina.strategies.contract import Placement
from lamina.strategies.dp.compiled_step import DataParallelCompiledStep
from lamina.strategies.dp.planner import DataParallelState
from lamina.strategies.registry import get_strategy
from lamina.strategies.wrap_pipeline import DISTRIBUTED_WITH, distribute_with
from lamina.strategies.zero3.compiled_step import ShardedCompiledStep
from lamina.strategies.zero3.module import ShardedModule


def distribute(
    model: nn.Module,
    strategy: str | Sequence[str] = "dp",
    *,
    placement: Placement | Mapping[str, Placement] | None = None,
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

    ``"auto"`` chooses the strategy, its placement and codec from predicted step time
    and memory (:mod:`lamina.auto`; its options: :class:`lamina.auto.AutoOptions`, with
    ``example_inputs`` required); ``model.lamina_auto`` says what it chose and why.

    A list composes strategies, each on its own mesh axes
    (:mod:`lamina.strategies.compose`): ``["tp", "zero3"]`` on
    ``lamina.init(mesh={"fsdp": 2, "tp": 2})``; each keyword goes to the strategies that
    take it, and ``placement`` maps a strategy's name to its axes.
    """
    runtime = runtime or current() or init()
    if runtime.world_size != runtime.mesh.size():
        raise ConfigError(
            f"mesh {runtime.mesh} holds {runtime.mesh.size()} rank(s) but the job has "
            f"{runtime.world_size}; call lamina.init() with mesh='flat' or a mesh shape whose "
            "product is the world size"
        )
    from lamina.auto.choose import auto_requested, distribute_auto, forced_options

    if auto_requested(strategy):
        if placement is not None:
            raise ConfigError(
                "strategy 'auto' chooses the placement itself; drop placement= (or name the "
                "strategy to place it by hand)"
            )
        if strategy != "auto":  # lamina plan --auto: the script's own strategy is overridden
            options = forced_options(options)
        return distribute_auto(distribute, model, runtime, options, _declared_cluster())
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


def _declared_cluster() -> Any:
    """The cluster ``lamina plan --simulate CLUSTER --auto`` ranks for (None: the job)."""
    import os

    from lamina.envvars import AUTO_CLUSTER_ENV

    path = os.environ.get(AUTO_CLUSTER_ENV)
    if not path:
        return None
    from lamina.simulate import load_cluster

    return load_cluster(path)


def compile_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    backend: str | Callable[..., Any] = "inductor",
    max_shapes: int = 2,
    on_graph_break: str = "eager",
    eager_random: bool = True,
    device_graphs: bool = True,
    overlap: bool = False,
) -> CompiledStep:
    """The whole training step of ``model`` (distributed with ``dp``, ``zero3`` or
    ``hsdp``) as one captured graph: ``loss = step(*inputs, target)`` runs the forward,
    ``loss_fn(output, target)``, the backward, the plan's collectives and ``optimizer``'s
    update (see :mod:`lamina.strategies.compiled.step`); ``backend`` is
    ``torch.compile``'s. What cannot be captured runs the eager step, with the reason in
    ``step_summary()`` (``on_graph_break="error"``: a graph break raises, naming the
    module and the operation); a new input shape compiles again, counted, up to
    ``max_shapes`` shapes, and past that runs eagerly with the reason. With
    ``eager_random`` (the default) Inductor draws random numbers as eager does, so
    dropout's masks are the eager step's; False lets it generate its own (other masks).
    With ``device_graphs`` (the default), where the device captures a step (CUDA graphs)
    each compiled shape is replayed as one device graph from its second call. With
    ``overlap``, Inductor issues each collective as soon as its input is computed (DP's
    buckets where their last gradient is produced) and waits for it as late as it can."""
    settings = StepOptions(
        backend, max_shapes, on_graph_break, eager_random, device_graphs, overlap
    )
    if "lamina_tp" in getattr(model, "__dict__", {}):
        raise ConfigError(
            "compile_step does not take a tensor-parallel model yet; run its step eagerly "
            "(loss.backward(); optimizer.step()), or distribute it without 'tp'"
        )
    runtime = current()
    job = StepJob(runtime.control_group, runtime.handle) if runtime is not None else StepJob()
    state = getattr(model, "__dict__", {}).get("lamina_dp")
    if isinstance(state, DataParallelState):
        return DataParallelCompiledStep(model, state, optimizer, loss_fn, settings, job)
    if isinstance(model, ShardedModule):
        return ShardedCompiledStep(model, optimizer, loss_fn, settings, job)
    strategy = getattr(model, "__dict__", {}).get(DISTRIBUTED_WITH, "no strategy")
    raise ConfigError(
        f"compile_step takes a model distributed with 'dp', 'zero3' or 'hsdp' (this one: "
        f"{strategy}); call lamina.distribute(model, 'dp') (or 'zero3', 'hsdp') first"
    )


def loss_parallel(model: nn.Module) -> AbstractContextManager[None]:
    """``with lamina.loss_parallel(model):`` the model's vocabulary-parallel head keeps its
    logits split and ``F.cross_entropy`` on them runs across the tp group, never
    gathering the whole vocabulary (:mod:`lamina.strategies.tp.loss_parallel`)."""
    from lamina.strategies.tp.loss_parallel import loss_parallel as on_slices

    return on_slices(model)
