"""``lamina.distribute``: the one call that turns a model into a distributed one."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lamina.errors import ConfigError
from lamina.session import Runtime, current, init
from lamina.strategies.compiled.step import StepJob, StepOptions, TrainingStep
from lamina.strategies.compose import distribute_named
from lamina.strategies.contract import Placement
from lamina.strategies.registry import get_strategy
from lamina.strategies.wrap_pipeline import DISTRIBUTED_WITH, extra_plan_meta

if TYPE_CHECKING:
    from lamina.auto.choose import Distribution

#: The strategy name of the automatic choice (:mod:`lamina.auto`).
AUTO = "auto"


@dataclass(frozen=True)
class AutoRequest:
    """``lamina plan --auto``'s request to the script it runs (:func:`request_auto`): every
    ``lamina.distribute`` call chooses as ``"auto"`` does, whatever strategy it names (its
    ``example_inputs`` kept, its other options dropped). With ``cluster`` (a cluster file,
    ``--simulate CLUSTER --auto``), the candidates are ranked for that declared cluster,
    each priced from its plans in the folder ``cluster_plans``, and
    :class:`~lamina.auto.RankedOnly` is raised with the ranking instead; with
    ``planning`` too, this process stands as a rank of the cluster
    (:func:`lamina.auto.cluster_planning.join_as_cluster_rank`): every candidate is planned
    and written to ``cluster_plans``, and :class:`~lamina.auto.choose.CandidatesPlanned`
    is raised."""

    cluster: str | None = None
    cluster_plans: str | None = None
    planning: bool = False


#: What the rank runner of ``lamina plan --auto`` asked of this process (None: nothing).
_AUTO_REQUEST: AutoRequest | None = None


def request_auto(request: AutoRequest | None) -> None:
    """Make every later :func:`distribute` call of this process choose as ``"auto"`` does
    (see :class:`AutoRequest`); ``None`` cancels the request. The rank runner of ``lamina
    plan --auto`` calls it beside :func:`lamina.strategies.preflight.request_stop`."""
    if request is not None and not isinstance(request, AutoRequest):
        raise ValueError(f"request_auto takes an AutoRequest or None, got {request!r}")
    global _AUTO_REQUEST
    _AUTO_REQUEST = request


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
    ``example_inputs`` required), then distributes the model with them as if given by
    hand; ``model.lamina_auto`` says what it chose and why.

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
    requested = _AUTO_REQUEST
    if strategy == AUTO or requested is not None:
        if placement is not None and strategy == AUTO:
            raise ConfigError(
                "strategy 'auto' chooses the placement itself; drop placement= (or name the "
                "strategy to place it by hand)"
            )
        return _distribute_auto(model, runtime, strategy, options, requested)
    return distribute_named(model, strategy, runtime, placement, options)


def _distribute_auto(
    model: nn.Module,
    runtime: Runtime,
    strategy: str | Sequence[str],
    options: Mapping[str, Any],
    requested: AutoRequest | None,
) -> nn.Module:
    """``"auto"``: :func:`lamina.auto.choose.choose` chooses, then the choice is applied
    (:func:`apply_distribution`) and recorded as ``model.lamina_auto``; under ``lamina
    plan --auto`` (``requested``) whatever ``strategy`` names, and with a declared
    cluster :class:`~lamina.auto.RankedOnly` carries the ranking instead."""
    from lamina.auto.choose import (
        CandidatesPlanned,
        RankedOnly,
        choose,
        forced_options,
        rank_cluster,
    )

    if strategy != AUTO:  # lamina plan --auto: the script's own strategy is overridden
        options = forced_options(options)
    if requested is not None and requested.cluster is not None:
        from lamina.auto.cluster_planning import write_candidate_plans
        from lamina.simulate import load_cluster

        if requested.cluster_plans is None:
            raise ConfigError(
                "ranking for a declared cluster needs the folder of its candidates' plans; "
                "run lamina plan --simulate CLUSTER --auto, which makes them"
            )
        if requested.planning:
            folder = requested.cluster_plans
            raise CandidatesPlanned(write_candidate_plans(model, runtime, options, folder))
        cluster = load_cluster(requested.cluster)
        raise RankedOnly(rank_cluster(model, runtime, options, cluster, requested.cluster_plans))
    choice = choose(model, runtime, options)
    distributed = apply_distribution(model, choice.distribution, runtime)
    distributed.__dict__["lamina_auto"] = choice
    return distributed


def apply_distribution(
    model: nn.Module, distribution: Distribution, runtime: Runtime | None = None
) -> nn.Module:
    """``model`` distributed as ``distribution`` says (``"auto"``'s choice, or any
    candidate's: :func:`lamina.auto.choose.distribution_for`), through the same sequence
    as strategies given by hand; every plan it sets up carries ``distribution.meta``."""
    runtime = runtime or current() or init()
    with extra_plan_meta(distribution.meta):
        return distribute_named(
            model, distribution.strategy, runtime, distribution.placement, distribution.options
        )


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
    max_norm: float | None = None,
    norm_type: float = 2.0,
) -> TrainingStep:
    """The whole training step of ``model`` (distributed with ``dp``, ``zero3`` or
    ``hsdp``, or with ``tp`` composed with ``zero3`` or ``hsdp``) as one captured graph,
    built by the strategy that distributed it (the sharding one of a composition, tp's
    collectives captured with the forward:
    :meth:`~lamina.strategies.contract.Strategy.compiled_step`; another strategy, or
    composition, is refused in one line saying what to run instead):
    ``loss = step(*inputs, target)`` runs the forward, ``loss_fn(output, target)``, the
    backward, the plan's collectives and ``optimizer``'s update (see
    :mod:`lamina.strategies.compiled.step`); ``backend`` is ``torch.compile``'s. What
    cannot be captured runs the eager step, with the reason in ``step_summary()``
    (``on_graph_break="error"``: a graph break raises, naming the module and the
    operation); a new input shape compiles again, counted, up to ``max_shapes`` shapes,
    and past that runs eagerly with the reason. With ``eager_random`` (the default)
    Inductor draws random numbers as eager does, so dropout's masks are the eager step's;
    False lets it generate its own (other masks). With ``device_graphs`` (the default),
    where the device captures a step (CUDA graphs) each compiled shape is replayed as one
    device graph from its second call. With ``overlap``, Inductor issues each collective
    as soon as its input is computed (DP's buckets where their last gradient is produced)
    and waits for it as late as it can. With ``max_norm`` the gradients are clipped to
    that total norm (``norm_type``) before the update, as
    ``torch.nn.utils.clip_grad_norm_`` clips the whole model's; the norm before clipping
    is ``step.last_grad_norm`` after each step (inside the graph of ``dp``, ``zero3`` and
    ``hsdp``; a strategy whose graph does not clip runs the eager step to clip, a declared
    fallback)."""
    settings = StepOptions(
        backend,
        max_shapes,
        on_graph_break,
        eager_random,
        device_graphs,
        overlap,
        max_norm,
        norm_type,
    )
    runtime = current()
    job = StepJob(runtime.control_group, runtime.handle) if runtime is not None else StepJob()
    name = getattr(model, "__dict__", {}).get(DISTRIBUTED_WITH)
    if not isinstance(name, str):
        raise ConfigError(
            "compile_step takes a model distributed with 'dp', 'zero3' or 'hsdp' (this one: "
            "no strategy); call lamina.distribute(model, 'dp') (or 'zero3', 'hsdp') first"
        )
    plugins = runtime.plugins if runtime is not None else None
    if "+" in name:  # a composition: the sharder compiles, the others' forward is traced
        return _composed_compiled_step(model, name, optimizer, loss_fn, settings, job, plugins)
    strategy = get_strategy(name, plugins)
    return strategy.compiled_step(model, optimizer, loss_fn, settings, job)


def _composed_compiled_step(
    model: nn.Module,
    name: str,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    settings: StepOptions,
    job: StepJob,
    plugins: Any,
) -> TrainingStep:
    """The compiled step of a composition: built by its sharding strategy, the others'
    collectives captured with the forward (tp x zero3, tp x hsdp); any other one is
    refused in one line saying what to run instead."""
    composed = [get_strategy(n, plugins) for n in name.split("+")]
    pipeline = next((s for s in composed if s.role == "pipeline"), None)
    if pipeline is not None:  # its stages sharded by the sharder's eager gathers
        inner = [s.name for s in composed if s.role not in ("pipeline", "shard")]
        if inner:
            raise ConfigError(
                f"compile_step does not take a pipelined model composed with {inner[0]!r} "
                f"yet (its collectives run inside the stages' blocks); run its step eagerly "
                f"({pipeline.eager_step}), or compose 'pp' with 'zero3' or 'hsdp' alone"
            )
        return pipeline.compiled_step(model, optimizer, loss_fn, settings, job)
    sharder = next((s for s in composed if s.role == "shard"), None)
    others = [s for s in composed if s is not sharder]
    inside = [s.in_graph(model) for s in others]
    if sharder is None or any(c is None for c in inside):
        untraced = [s.name for s, c in zip(others, inside, strict=True) if c is None]
        why = f"{untraced[0]!r}'s collectives are not captured" if untraced else "no sharder"
        raise ConfigError(
            f"compile_step does not take a model of composed strategies {name!r} yet "
            f"({why}); run its step eagerly ({composed[0].eager_step}), or compose 'tp' with "
            "'zero3' or 'hsdp'"
        )
    return sharder.compiled_step(
        model, optimizer, loss_fn, settings, job, [c for c in inside if c is not None]
    )


def loss_parallel(model: nn.Module) -> AbstractContextManager[None]:
    """``with lamina.loss_parallel(model):`` the model's vocabulary-parallel head keeps its
    logits split and ``F.cross_entropy`` on them runs across the tp group, never
    gathering the whole vocabulary (:mod:`lamina.strategies.tp.loss_parallel`)."""
    from lamina.strategies.tp.loss_parallel import loss_parallel as on_slices

    return on_slices(model)
