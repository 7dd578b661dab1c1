"""``lamina.distribute(model, "auto")``: measure, predict, rank, check, choose.

1. The model is timed on ``example_inputs`` (:mod:`lamina.auto.measure`), every rank at
   once, and every op of every group the candidates use is timed on the job
   (:class:`~lamina.auto.comm.MeasuredComm`), or costed on a declared cluster
   (:class:`~lamina.auto.comm.ClusterComm`, ``lamina plan --simulate CLUSTER --auto``).
2. Every candidate of the mesh (:mod:`lamina.auto.candidates`) is priced from its plan
   and ranked (:mod:`lamina.auto.ranking`): its plan is made on a copy of the model
   (:mod:`lamina.auto.plans`; for a declared cluster, by planning processes standing as
   ranks of it, :mod:`lamina.auto.cluster_plans`) and priced node by node
   (:mod:`lamina.auto.pricing`, :func:`lamina.simulate.step.price_step`); the fastest
   that fits the device's memory is chosen, or a one-line error says that none fits.
3. The ranks check that they chose alike (the pre-flight verifier, on the choice and
   every prediction).

:func:`choose` only chooses: it returns an :class:`AutoChoice` whose
:class:`Distribution` says what to distribute the model with (the strategies by name,
each one's placement, the options, the plan ``meta`` recording the choice: ``auto`` and
``auto_ranking``, every candidate as JSON), and ``lamina.distribute`` applies it as it
applies strategies given by hand, then sets ``model.lamina_auto``. Nothing here
distributes, keeps state between calls or reads the environment: ``lamina plan --auto``
asks ``lamina.distribute`` itself (:func:`lamina.api.request_auto`).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.auto.candidates import PIPELINE_SCHEDULE, Candidate, candidates_for
from lamina.auto.comm import ClusterComm, CommCosts, MeasuredComm
from lamina.auto.measure import (
    PROFILE_RUNS,
    ModelProfile,
    backward_of,
    batch_rows,
    profile_model,
    rows_of,
)
from lamina.auto.plans import plan_candidate
from lamina.auto.pricing import PlanPrices, priced_with_spread
from lamina.auto.ranking import MEMORY_MARGIN, Ranking, rank_candidates
from lamina.errors import ConfigError
from lamina.graph.state import preserved
from lamina.simulate.step import PricedStep
from lamina.strategies.contract import Placement, StrategyOptions

if TYPE_CHECKING:
    from lamina.auto.cluster_plans import ClusterPlans
    from lamina.session import Runtime
    from lamina.simulate.cluster import Cluster

#: The name ``lamina.distribute`` takes for the automatic choice.
AUTO = "auto"
#: The sequence (tokens an attention call sees) from which context parallelism is
#: considered: below it attention is a small share of the step and splitting the
#: sequence only adds collectives.
CONTEXT_MIN_TOKENS = 4096


@dataclass(frozen=True)
class AutoOptions(StrategyOptions):
    """The options of ``lamina.distribute(model, "auto", ...)``.

    ``example_inputs`` (and ``example_kwargs``): one rank's batch as data parallelism
    gives it (required: the model is timed on it; the global batch is its rows times the
    ranks, for every candidate). ``allow_lossy``: also consider lossy codecs (bf16, fp8)
    on ``dp``'s buckets. ``device_memory``: bytes one rank may use (default: the
    device's; on CPU the host's memory shared among its ranks). ``memory_margin``: the
    share of it kept free. ``microbatches``: per pipelined step (0: twice the stages).
    ``timing_runs``: timed runs per measurement. ``verify``: the pre-flight checks.
    ``global_batch``: rows per step over the whole job (default: ``example_inputs``'
    rows times the ranks); fewer rows than ranks leaves only the candidates that split
    a row (context or tensor parallelism, a pipeline). ``context_min_tokens``: the
    sequence from which context parallelism is a candidate.
    """

    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: dict[str, Any] | None = None
    allow_lossy: bool = False
    device_memory: int | None = None
    memory_margin: float = MEMORY_MARGIN
    microbatches: int = 0
    timing_runs: int = PROFILE_RUNS
    global_batch: int | None = None
    context_min_tokens: int = CONTEXT_MIN_TOKENS

    def __post_init__(self) -> None:
        if self.example_inputs is None or not isinstance(self.example_inputs, tuple):
            raise ConfigError(
                "strategy 'auto' times the model on one batch before choosing: pass "
                "example_inputs=(batch,) with one rank's batch"
            )
        if not 0 <= self.memory_margin < 1:
            raise ConfigError(f"memory_margin must be in [0, 1), got {self.memory_margin}")
        if self.device_memory is not None and not self.device_memory > 0:
            raise ConfigError(
                f"device_memory must be a positive byte count, got {self.device_memory}"
            )
        if self.global_batch is not None and (
            isinstance(self.global_batch, bool)
            or not isinstance(self.global_batch, int)
            or self.global_batch < 1
        ):
            raise ConfigError(
                f"global_batch must be a positive row count, got {self.global_batch!r}"
            )
        for name in ("microbatches", "timing_runs", "context_min_tokens"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (name == "timing_runs")
            ):
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class Distribution:
    """A candidate as ``lamina.distribute`` takes strategies by hand: their names, each
    one's :class:`~lamina.strategies.contract.Placement`, the keyword options (each goes
    to the strategies that take it), and ``meta`` items every plan set up while applying
    it carries (``"auto"``'s choice and ranking; empty for a candidate given by hand)."""

    strategies: tuple[str, ...]
    placements: Mapping[str, Placement]
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    meta: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def strategy(self) -> str | list[str]:
        """``lamina.distribute``'s ``strategy``: one name, or the composition's list."""
        return self.strategies[0] if len(self.strategies) == 1 else list(self.strategies)

    @property
    def placement(self) -> Placement | dict[str, Placement]:
        """``lamina.distribute``'s ``placement``: the one strategy's, or name -> axes."""
        if len(self.strategies) == 1:
            return self.placements[self.strategies[0]]
        return dict(self.placements)


@dataclass(frozen=True)
class AutoChoice:
    """What ``"auto"`` chose and why (:func:`choose`), on the distributed model as
    ``model.lamina_auto``; ``distribution`` is what ``lamina.distribute`` applied."""

    ranking: Ranking
    candidate: Candidate
    profile: ModelProfile = field(repr=False)
    distribution: Distribution = field(repr=False)
    #: This rank's data replica and how many there are (each takes its own batch).
    replica: tuple[int, int] = (0, 1)
    #: Rows of one replica's batch per step (the global batch over the replicas).
    replica_rows: int = 0
    #: Rows of the global batch per step.
    global_rows: int = 0

    @property
    def strategy(self) -> str:
        """The chosen strategies as ``lamina.distribute`` names them (``pp+zero3``)."""
        return "+".join(self.candidate.strategies)


class CandidatesPlanned(BaseException):
    """Raised out of the script by a planning process of ``lamina plan --simulate CLUSTER
    --auto`` (:func:`lamina.auto.cluster_planning.join_as_cluster_rank`): every candidate
    was planned as this rank of the cluster and written to ``path``."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"planned the candidates into {path}")
        self.path = path


class RankedOnly(BaseException):
    """Raised out of the script by ``lamina plan --simulate CLUSTER --auto``: the ranking
    for the declared cluster, with nothing distributed (its mesh is not this job's)."""

    def __init__(self, ranking: Ranking) -> None:
        super().__init__("ranked the candidates for a declared cluster")
        self.ranking = ranking


#: ``lamina.distribute``'s signature (what :func:`distribute_candidate` applies through).
Distribute = Callable[..., nn.Module]


def choose(model: nn.Module, runtime: Runtime, options: Mapping[str, Any]) -> AutoChoice:
    """The candidate :func:`rank_for` chooses for ``model`` on the job, with the ranking,
    the profile and the :class:`Distribution` that applies it (see the module); every
    rank chooses alike (checked), nothing is distributed. ``options``: ``"auto"``'s
    (:class:`AutoOptions`); a ConfigError when no candidate fits the device's memory."""
    opts = AutoOptions.from_kwargs(AUTO, options)
    ranking, profile = rank_for(model, runtime, opts)
    chosen = ranking.choice()
    _check_alike(runtime, ranking, opts)
    assert chosen.prediction is not None
    if runtime.is_main:
        print(
            f"lamina: strategy 'auto' chose {chosen.candidate.label} (predicted "
            f"{chosen.prediction.step_s * 1e3:.1f} ms per step, "
            f"{len(ranking.entries)} candidates ranked; model.lamina_auto.ranking.table() "
            "shows them)",
            file=sys.stderr,
            flush=True,
        )
    candidate = chosen.candidate
    meta = (
        ("auto", f"{candidate.label} (predicted {chosen.prediction.step_s * 1e3:.1f} ms)"),
        ("auto_ranking", ranking.record()),
    )
    inputs = opts.example_inputs
    assert inputs is not None
    global_rows = global_rows_of(opts, runtime.world_size)
    distribution = distribution_for(
        candidate,
        inputs,
        opts.example_kwargs,
        verify=opts.verify,
        meta=meta,
        global_rows=global_rows,
    )
    rows = global_rows // candidate.data_replicas
    replica = replica_of(runtime, candidate)
    return AutoChoice(ranking, candidate, profile, distribution, replica, rows, global_rows)


def global_rows_of(opts: AutoOptions, world_size: int) -> int:
    """Rows of the global batch per step: ``global_batch``, or the example's rows on
    every rank."""
    if opts.global_batch is not None:
        return opts.global_batch
    inputs = opts.example_inputs
    assert inputs is not None
    return batch_rows(inputs) * world_size


def rank_cluster(
    model: nn.Module,
    runtime: Runtime,
    options: Mapping[str, Any],
    cluster: Cluster,
    plans: str | Path,
) -> Ranking:
    """The candidates ranked for the declared ``cluster`` (its mesh, links and device
    memory; ``model`` timed on this job's device; each candidate priced from the plans
    the cluster's planning ranks wrote to the folder ``plans``,
    :mod:`lamina.auto.cluster_plans`), checked alike on every rank: what ``lamina plan
    --simulate CLUSTER --auto`` prints (raised as :class:`RankedOnly`)."""
    from lamina.auto.cluster_plans import read_candidate_plans

    opts = AutoOptions.from_kwargs(AUTO, options)
    planned = read_candidate_plans(plans, cluster)
    ranking, _profile = rank_for(model, runtime, opts, cluster, planned)
    _check_alike(runtime, ranking, opts)
    return ranking


def candidates_of(axes: tuple[tuple[str, int], ...], opts: AutoOptions) -> list[Candidate]:
    """Every candidate of a mesh of ``axes`` that ``opts`` allows, context and expert
    parallelism among them (the profile drops those the model has no use for)."""
    return candidates_for(
        axes,
        allow_lossy=opts.allow_lossy,
        microbatches=opts.microbatches,
        context=True,
        experts=True,
    )


def rank_for(
    model: nn.Module,
    runtime: Runtime,
    opts: AutoOptions,
    cluster: Cluster | None = None,
    plans: ClusterPlans | None = None,
) -> tuple[Ranking, ModelProfile]:
    """Measure ``model`` and rank the candidates of the job's mesh (or ``cluster``'s,
    each priced from its ``plans`` there)."""
    inputs = opts.example_inputs
    assert inputs is not None
    batch_rows(inputs)
    comm: CommCosts
    if cluster is not None:
        from lamina.auto.cluster_plans import with_default_mesh

        cluster = with_default_mesh(cluster)
        axes = cluster.mesh
        comm = ClusterComm(cluster)
        memory = opts.device_memory or cluster.device_memory_bytes
        where = f"links: the declared cluster {cluster.source} ({cluster.world_size} devices)"
    else:
        axes = tuple((a, runtime.mesh.size(a)) for a in runtime.mesh.axis_names)
        memory = opts.device_memory or device_memory_bytes(runtime)
    candidates = candidates_of(axes, opts)
    timed: list[MeasuredComm] = []

    params = list(model.parameters())

    def step() -> None:  # the model's forward + backward, as the overlap's compute
        backward_of(model(*inputs, **(opts.example_kwargs or {})))

    def calibrate() -> None:
        if cluster is None:
            with preserved(model):
                timed.append(
                    MeasuredComm.calibrate(
                        runtime, _groups(candidates), compute=step, parameters=params
                    )
                )
                model.zero_grad(set_to_none=True)

    profile = profile_model(
        model,
        inputs,
        opts.example_kwargs,
        runs=opts.timing_runs,
        device=runtime.device,
        synchronize=runtime.handle.synchronize,
        between=calibrate,
        dtensor_mesh=runtime.mesh.torch_mesh if cluster is None else None,
    )
    if cluster is None:
        comm = timed[0]
        where = f"links: timed on this job; {comm.describe()[0]}"
    tokens = profile.attention.tokens if profile.attention is not None else 0
    if tokens < opts.context_min_tokens:  # short sequences: cp only adds collectives
        candidates = [c for c in candidates if c.cp_degree == 1]
    if profile.experts is None:  # no MoE layer: nothing for ep to spread
        candidates = [c for c in candidates if c.ep_degree == 1]
    world = math.prod(size for _, size in axes)
    global_rows = global_rows_of(opts, world)
    price: Callable[[Candidate], PricedStep]
    if cluster is None:  # this job's mesh: each candidate planned here, its plan priced

        def price(candidate: Candidate) -> PricedStep:
            return price_candidate(model, candidate, runtime, opts, profile, comm, global_rows)

    else:  # the cluster's: each candidate's plans as its planning ranks made them
        from lamina.auto.cluster_plans import price_on_cluster

        if plans is None:
            raise ConfigError(
                f"ranking for the declared cluster {cluster.source} needs its candidates' "
                "plans; run lamina plan --simulate CLUSTER --auto, which makes them"
            )
        cluster_plans = plans

        def price(candidate: Candidate) -> PricedStep:
            return price_on_cluster(candidate, cluster_plans, profile, comm, global_rows)

    ranking = rank_candidates(
        candidates,
        profile,
        price,
        device_memory=memory,
        margin=opts.memory_margin,
        where=where,
        global_rows=global_rows,
    )
    return ranking, profile


def price_candidate(
    model: nn.Module,
    candidate: Candidate,
    runtime: Runtime,
    opts: AutoOptions,
    profile: ModelProfile,
    comm: CommCosts,
    global_rows: int,
) -> PricedStep:
    """``candidate``'s step on this job: its plan (:func:`lamina.auto.plans.plan_candidate`,
    no collective of the step issued) priced node by node
    (:func:`lamina.simulate.step.price_step`) from the profile and the fits, with the
    interval the measured spread gives (the compute at its quartiles); the slowest
    rank's step (a pipeline's stages hold different plans), alike on every rank."""
    inputs = opts.example_inputs
    assert inputs is not None
    given = distribution_for(
        candidate, inputs, opts.example_kwargs, verify=False, global_rows=global_rows
    )
    planned = plan_candidate(
        model, candidate, given, runtime, inputs, opts.example_kwargs, global_rows=global_rows
    )
    prices = PlanPrices(
        profile.at_rows(global_rows / runtime.world_size),
        comm,
        planned,
        tuple(runtime.mesh.axis_names),
    )
    priced, low, high = priced_with_spread(prices, profile.spread)
    # ranks of different stages hold different plans: the step is the slowest rank's
    step, low, high = _slowest_rank(runtime, [priced.step_s, low, high])
    return replace(priced, step_s=step, interval_s=(min(low, step), max(high, step)))


def _slowest_rank(runtime: Runtime, seconds: list[float]) -> list[float]:
    """``seconds`` as the slowest rank predicted each (collective: every rank)."""
    if runtime.world_size < 2:
        return seconds
    tensor = torch.tensor(seconds, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def _groups(candidates: list[Candidate]) -> set[tuple[str, ...]]:
    """Every axes tuple a candidate's collectives run over."""
    out: set[tuple[str, ...]] = set()
    for c in candidates:
        out.add(c.sync_axes())
        for use in c.uses:
            for axes in (use.shard, use.replicate):
                if axes:
                    out.add(axes)
    out.discard(())
    return out


def _check_alike(runtime: Runtime, ranking: Ranking, opts: AutoOptions) -> None:
    """Every rank ranked alike (the pre-flight verifier on the choice and predictions)."""
    if not opts.verify or runtime.world_size < 2:
        return
    from lamina.verify import Manifest, preflight

    lines = tuple(
        f"{e.candidate.label}: "
        + (
            f"{e.prediction.step_s * 1e6:.0f} us, {e.prediction.memory_bytes} B"
            if e.prediction
            else "-"
        )
        + (f" rejected ({e.rejected})" if e.rejected else "")
        for e in ranking.entries
    )
    chosen = ranking.chosen
    label = chosen.candidate.label if chosen else "none"
    manifest = Manifest(runtime.rank, (("auto choice", (label,)), ("auto ranking", lines)))
    preflight(manifest, group=runtime.control_group)


def distribution_for(
    candidate: Candidate,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    verify: bool = True,
    meta: tuple[tuple[str, str], ...] = (),
    global_rows: int | None = None,
) -> Distribution:
    """``candidate`` as ``lamina.distribute`` takes it by hand (pure: nothing runs).
    ``example_inputs``: one rank's batch under data parallelism; a pipeline, tensor- or
    context-parallel group gets one replica's share of ``global_rows`` (default: the
    example's rows on every rank)."""
    from lamina.strategies.registry import get_strategy

    options: dict[str, Any] = {}
    names = candidate.strategies
    rows = batch_rows(example_inputs)
    total = global_rows if global_rows is not None else rows * candidate.world_size
    takes = {n for n in names if "example_inputs" in get_strategy(n).options.names()}
    if takes:  # one data replica's batch: a pipeline's, a tensor or context group's
        replica_rows = total // candidate.data_replicas
        options["example_inputs"] = rows_of(example_inputs, replica_rows, rows)
        if example_kwargs is not None:
            options["example_kwargs"] = example_kwargs
    if "pp" in names:
        options.update(schedule=PIPELINE_SCHEDULE, microbatches=candidate.microbatches)
    if candidate.codec:
        options["codec"] = candidate.codec
    if not verify:
        options["verify"] = False
    placements = {
        u.strategy: Placement(shard=u.shard, replicate=u.replicate) for u in candidate.uses
    }
    return Distribution(names, placements, options, meta)


def distribute_candidate(
    distribute: Distribute,
    model: nn.Module,
    candidate: Candidate,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    runtime: Runtime | None = None,
    verify: bool = True,
) -> nn.Module:
    """``model`` distributed by ``distribute`` (``lamina.distribute``) as ``candidate``
    says, its strategies named as by hand (:func:`distribution_for`; a benchmark
    distributes every candidate so)."""
    given = distribution_for(candidate, example_inputs, example_kwargs, verify=verify)
    return distribute(
        model, given.strategy, placement=given.placement, runtime=runtime, **given.options
    )


def replica_of(runtime: Runtime, candidate: Candidate) -> tuple[int, int]:
    """This rank's data replica (its coordinates over the axes outside tp, pp and cp,
    in mesh order) and the number of replicas."""
    coords = runtime.mesh.coordinates()
    index, count = 0, 1
    for axis in candidate.batch_axes():
        size = runtime.mesh.size(axis)
        index, count = index * size + coords[axis], count * size
    return index, count


def device_memory_bytes(runtime: Runtime) -> int | None:
    """Bytes of memory one rank's device has: the accelerator's own (its runtime's
    device properties), or on CPU the host's physical memory shared by its ranks; None
    when the device does not say."""
    device = runtime.device
    if device.type == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        return int(total // max(1, runtime.local_world_size))
    module = getattr(torch, device.type, None)
    props = getattr(module, "get_device_properties", None)
    if props is not None:
        try:
            return int(props(device).total_memory)
        except (RuntimeError, AttributeError, AssertionError):
            return None
    return None


def forced_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Under ``lamina plan --auto`` with a script naming another strategy: the options
    ``"auto"`` takes (its example inputs), the others dropped."""
    return {k: v for k, v in options.items() if k in AutoOptions.names()}


__all__ = [
    "AUTO",
    "CONTEXT_MIN_TOKENS",
    "AutoChoice",
    "AutoOptions",
    "CandidatesPlanned",
    "Distribution",
    "RankedOnly",
    "candidates_of",
    "choose",
    "device_memory_bytes",
    "distribute_candidate",
    "distribution_for",
    "forced_options",
    "global_rows_of",
    "price_candidate",
    "rank_cluster",
    "rank_for",
    "replica_of",
]
