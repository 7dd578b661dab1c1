"""``lamina.distribute(model, "auto")``: measure, predict, rank, check, distribute.

1. The model is timed on ``example_inputs`` (:mod:`lamina.auto.measure`), every rank at
   once, and every op of every group the candidates use is timed on the job
   (:class:`~lamina.auto.comm.MeasuredComm`), or costed on a declared cluster
   (:class:`~lamina.auto.comm.ClusterComm`, ``lamina plan --simulate CLUSTER --auto``).
2. Every candidate of the mesh (:mod:`lamina.auto.candidates`) is predicted and ranked
   (:mod:`lamina.auto.ranking`); the fastest that fits the device's memory is chosen,
   or a one-line error says that none fits.
3. The ranks check that they chose alike (the pre-flight verifier, on the choice and
   every prediction), then the chosen strategies distribute the model as if given by
   hand. The ranking goes into the plan's ``meta`` (``auto``: the choice;
   ``auto_ranking``: every candidate as JSON), the run log's summary, and
   ``model.lamina_auto`` (:class:`AutoChoice`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
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
from lamina.auto.ranking import MEMORY_MARGIN, Ranking, rank_candidates
from lamina.errors import ConfigError
from lamina.graph.state import preserved
from lamina.strategies.contract import StrategyOptions

if TYPE_CHECKING:
    from lamina.session import Runtime
    from lamina.simulate.cluster import Cluster

#: The name ``lamina.distribute`` takes for the automatic choice.
AUTO = "auto"
#: The candidates being handed to ``distribute`` (under ``lamina plan --auto`` that call
#: distributes them, not ``"auto"`` again).
_HANDING_ON: list[Candidate] = []


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
    """

    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: dict[str, Any] | None = None
    allow_lossy: bool = False
    device_memory: int | None = None
    memory_margin: float = MEMORY_MARGIN
    microbatches: int = 0
    timing_runs: int = PROFILE_RUNS

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
        for name in ("microbatches", "timing_runs"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (name == "timing_runs")
            ):
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class AutoChoice:
    """What ``"auto"`` chose and why, on the distributed model as ``model.lamina_auto``."""

    ranking: Ranking
    candidate: Candidate
    profile: ModelProfile = field(repr=False)
    #: This rank's data replica and how many there are (each takes its own batch).
    replica: tuple[int, int] = (0, 1)
    #: Rows of one replica's batch per step (the global batch over the replicas).
    replica_rows: int = 0

    @property
    def strategy(self) -> str:
        """The chosen strategies as ``lamina.distribute`` names them (``pp+zero3``)."""
        return "+".join(self.candidate.strategies)


class RankedOnly(BaseException):
    """Raised out of the script by ``lamina plan --simulate CLUSTER --auto``: the ranking
    for the declared cluster, with nothing distributed (its mesh is not this job's)."""

    def __init__(self, ranking: Ranking) -> None:
        super().__init__("ranked the candidates for a declared cluster")
        self.ranking = ranking


#: ``lamina.distribute``'s signature, which ``"auto"`` is handed (it sits below the API).
Distribute = Callable[..., nn.Module]


def distribute_auto(
    distribute: Distribute,
    model: nn.Module,
    runtime: Runtime,
    options: Mapping[str, Any],
    cluster: Cluster | None = None,
) -> nn.Module:
    """``model`` distributed by ``distribute`` (``lamina.distribute``) with the
    candidate :func:`rank_for` chooses (see the module); with ``cluster``,
    :class:`RankedOnly` carrying the ranking for it."""
    opts = AutoOptions.from_kwargs(AUTO, options)
    ranking, profile = rank_for(model, runtime, opts, cluster)
    if cluster is not None:
        _check_alike(runtime, ranking, opts)
        raise RankedOnly(ranking)
    chosen = ranking.choice()
    _check_alike(runtime, ranking, opts)
    if runtime.is_main:
        assert chosen.prediction is not None
        print(
            f"lamina: strategy 'auto' chose {chosen.candidate.label} (predicted "
            f"{chosen.prediction.step_s * 1e3:.1f} ms per step, "
            f"{len(ranking.entries)} candidates ranked; model.lamina_auto.ranking.table() "
            "shows them)",
            file=sys.stderr,
            flush=True,
        )
    distributed = _distribute_chosen(distribute, model, runtime, chosen.candidate, opts, ranking)
    candidate = chosen.candidate
    replica = replica_of(runtime, candidate)
    rows = profile.batch * runtime.world_size // candidate.data_replicas
    distributed.__dict__["lamina_auto"] = AutoChoice(ranking, candidate, profile, replica, rows)
    return distributed


def rank_for(
    model: nn.Module, runtime: Runtime, opts: AutoOptions, cluster: Cluster | None = None
) -> tuple[Ranking, ModelProfile]:
    """Measure ``model`` and rank the candidates of the job's mesh (or ``cluster``'s)."""
    inputs = opts.example_inputs
    assert inputs is not None
    batch_rows(inputs)
    comm: CommCosts
    if cluster is not None:
        from lamina.simulate.cluster import with_mesh

        if not cluster.mesh:
            mesh = {"inter": cluster.hosts, "intra": cluster.devices_per_host}
            cluster = with_mesh(cluster, mesh, cluster.source)
        axes = cluster.mesh
        comm = ClusterComm(cluster)
        memory = opts.device_memory or cluster.device_memory_bytes
        where = f"links: the declared cluster {cluster.source} ({cluster.world_size} devices)"
    else:
        axes = tuple((a, runtime.mesh.size(a)) for a in runtime.mesh.axis_names)
        memory = opts.device_memory or device_memory_bytes(runtime)
    candidates = candidates_for(axes, allow_lossy=opts.allow_lossy, microbatches=opts.microbatches)
    timed: list[MeasuredComm] = []

    def step() -> None:  # the model's forward + backward, as the overlap's compute
        backward_of(model(*inputs, **(opts.example_kwargs or {})))

    def calibrate() -> None:
        if cluster is None:
            with preserved(model):
                timed.append(MeasuredComm.calibrate(runtime, _groups(candidates), compute=step))
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
    ranking = rank_candidates(
        candidates, profile, comm, device_memory=memory, margin=opts.memory_margin, where=where
    )
    return ranking, profile


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


def _distribute_chosen(
    distribute: Distribute,
    model: nn.Module,
    runtime: Runtime,
    candidate: Candidate,
    opts: AutoOptions,
    ranking: Ranking,
) -> nn.Module:
    from lamina.strategies.wrap_pipeline import extra_plan_meta

    chosen = ranking.chosen
    assert chosen is not None and chosen.prediction is not None
    meta = (
        ("auto", f"{candidate.label} (predicted {chosen.prediction.step_s * 1e3:.1f} ms)"),
        ("auto_ranking", ranking.record()),
    )
    inputs = opts.example_inputs
    assert inputs is not None
    with extra_plan_meta(meta):
        return distribute_candidate(
            distribute,
            model,
            candidate,
            inputs,
            opts.example_kwargs,
            runtime=runtime,
            verify=opts.verify,
        )


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
    says, as if given by hand (what ``"auto"`` does with its choice; a benchmark with
    every candidate). ``example_inputs``: one rank's batch under data parallelism (a
    pipeline or tensor-parallel group gets as many rows as its ranks hold)."""
    from lamina.strategies.contract import Placement
    from lamina.strategies.registry import get_strategy

    options: dict[str, Any] = {}
    names = candidate.strategies
    rows = batch_rows(example_inputs)
    takes = {n for n in names if "example_inputs" in get_strategy(n).options.names()}
    if takes:  # one data replica's batch: a pipeline's, a tensor-parallel group's
        replica_rows = rows * candidate.world_size // candidate.data_replicas
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
    _HANDING_ON.append(candidate)  # the chosen strategies, not "auto" again
    try:
        if len(names) == 1:
            return distribute(
                model, names[0], placement=placements[names[0]], runtime=runtime, **options
            )
        return distribute(model, list(names), placement=placements, runtime=runtime, **options)
    finally:
        _HANDING_ON.pop()


def replica_of(runtime: Runtime, candidate: Candidate) -> tuple[int, int]:
    """This rank's data replica (its coordinates over the axes outside tp and pp, in
    mesh order) and the number of replicas."""
    coords = runtime.mesh.coordinates()
    index, count = 0, 1
    for axis in candidate.sync_axes():
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


def auto_requested(strategy: object) -> bool:
    """Whether ``lamina.distribute`` is to choose: ``"auto"`` given, or ``lamina plan
    --auto`` running the script."""
    from lamina.envvars import AUTO_ENV

    forced = os.environ.get(AUTO_ENV) == "1" and not _HANDING_ON
    return strategy == AUTO or forced


def forced_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Under ``lamina plan --auto`` with a script naming another strategy: the options
    ``"auto"`` takes (its example inputs), the others dropped."""
    return {k: v for k, v in options.items() if k in AutoOptions.names()}


__all__ = [
    "AUTO",
    "AutoChoice",
    "AutoOptions",
    "RankedOnly",
    "auto_requested",
    "device_memory_bytes",
    "distribute_auto",
    "distribute_candidate",
    "forced_options",
    "rank_for",
    "replica_of",
]
