"""The candidates' plans on a declared cluster, read back and priced: what ``lamina plan
--simulate CLUSTER --auto`` ranks.

The job that ranks for a declared cluster is not that cluster: its mesh is this
machine's. Each candidate is therefore planned by planning processes standing as ranks
of the cluster (:mod:`lamina.auto.cluster_planning`), which write the plans to a
folder. The ranking job reads them back (:func:`read_candidate_plans`) and prices each
plan's nodes (:func:`price_on_cluster`) as it prices its own on a running job: compute
from the model it measured here, collectives from the cluster's links
(:class:`~lamina.auto.comm.ClusterComm`). There is no second set of formulas. A
pipeline's stage nodes carry the seconds the planning rank's cut measured, on a process
sharing this machine with the other planning rank, cold: their shares are kept (how the
cut balanced the stages) and their sum is brought to the model's forward and backward as
the ranking job measured them (:func:`stage_scale`).

The ranks planned (:func:`planning_ranks`) are the first and the last: the first and
the last stage of a pipeline on any axis (the stages holding the embedding and the
head), and the largest and the smallest shard of a padded ZeRO-3 split. The step is the
slower of the two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lamina.auto.comm import CommCosts
from lamina.auto.measure import ModelProfile
from lamina.auto.plans import CandidatePlan
from lamina.auto.pricing import PlanPrices, priced_with_spread
from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan
from lamina.runtime.nodes import Compute
from lamina.simulate.step import PricedStep, is_stage

if TYPE_CHECKING:
    from lamina.auto.candidates import Candidate
    from lamina.simulate.cluster import Cluster

#: The file each planning rank writes into the plans folder.
PLANS_FILE = "candidates.rank{rank}.json"
#: The format of that file (its ``"version"``).
PLANS_VERSION = 1


def planning_ranks(world_size: int) -> tuple[int, ...]:
    """The ranks of a ``world_size``-device cluster each candidate is planned on (see
    the module)."""
    return (0,) if world_size < 2 else (0, world_size - 1)


def with_default_mesh(cluster: Cluster) -> Cluster:
    """``cluster`` with its declared mesh, else ``inter`` (hosts) x ``intra`` (devices
    of a host)."""
    from lamina.simulate.cluster import with_mesh

    if cluster.mesh:
        return cluster
    mesh = {"inter": cluster.hosts, "intra": cluster.devices_per_host}
    return with_mesh(cluster, mesh, cluster.source)


@dataclass(frozen=True)
class ClusterPlans:
    """The candidates' plans as each planning rank of a declared cluster made them."""

    world_size: int
    mesh: tuple[tuple[str, int], ...]
    #: Planning rank -> candidate label -> its plan, or why its strategies refused.
    by_rank: dict[int, dict[str, CandidatePlan | str]]

    def of(self, label: str) -> list[CandidatePlan]:
        """``label``'s plan on every planning rank; ConfigError (the reason) when its
        strategies refused the model, or when it was not planned."""
        found: list[CandidatePlan] = []
        for rank, plans in sorted(self.by_rank.items()):
            planned = plans.get(label)
            if planned is None:
                raise ConfigError(
                    f"candidate {label} was not planned as rank {rank} of the cluster; "
                    "rerun lamina plan --simulate CLUSTER --auto"
                )
            if isinstance(planned, str):
                raise ConfigError(planned)
            found.append(planned)
        return found


def read_candidate_plans(folder: str | Path, cluster: Cluster) -> ClusterPlans:
    """The plans :func:`~lamina.auto.cluster_planning.write_candidate_plans` wrote into
    ``folder`` for ``cluster``; a one-line ConfigError naming the file when one is
    missing, unreadable, or made for another cluster's mesh."""
    cluster = with_default_mesh(cluster)
    by_rank: dict[int, dict[str, CandidatePlan | str]] = {}
    for rank in planning_ranks(cluster.world_size):
        path = Path(folder) / PLANS_FILE.format(rank=rank)
        fix = "rerun lamina plan --simulate CLUSTER --auto, which writes it"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"candidate plans {path}: cannot be read ({exc}); {fix}") from None
        if not isinstance(data, dict) or data.get("version") != PLANS_VERSION:
            raise ConfigError(
                f"candidate plans {path}: not version {PLANS_VERSION} of lamina's format; {fix}"
            )
        mesh = tuple((str(a), int(n)) for a, n in data.get("mesh", ()))
        if data.get("world_size") != cluster.world_size or mesh != cluster.mesh:
            raise ConfigError(
                f"candidate plans {path}: made for mesh {dict(mesh)} of "
                f"{data.get('world_size')} ranks, not {cluster.describe_mesh()}; {fix}"
            )
        by_rank[rank] = {
            label: record["refused"] if "refused" in record else _planned(record)
            for label, record in data["candidates"].items()
        }
    return ClusterPlans(cluster.world_size, cluster.mesh, by_rank)


def _planned(record: dict[str, Any]) -> CandidatePlan:
    return CandidatePlan(
        ExecutionPlan.from_dict(record["plan"]),
        tuple(ExecutionPlan.from_dict(p) for p in record["parts"]),
        int(record["held_numel"]),
        bool(record["dtensors"]),
    )


def stage_scale(planned: CandidatePlan, profile: ModelProfile) -> float:
    """What the planning rank's stage seconds are multiplied by: one pipeline's forward
    and backward as ``profile`` measured them (its ranks' rows each, ``profile`` at one
    rank's rows) over the sum its stage nodes give (every stage, every microbatch); 1
    without a pipeline."""
    pipeline = planned.pipeline
    if pipeline is None:
        return 1.0
    stages = [n.detail for n in pipeline.nodes if is_stage(n) and isinstance(n.detail, Compute)]
    timed = sum(d.seconds or 0.0 for d in stages)
    ranks = len({d.rank for d in stages})
    if timed <= 0:
        return 1.0
    return (profile.forward_s + profile.backward_s) * ranks / timed


def price_on_cluster(
    candidate: Candidate,
    plans: ClusterPlans,
    profile: ModelProfile,
    comm: CommCosts,
    global_rows: int,
) -> PricedStep:
    """``candidate``'s step on the declared cluster: its plan on each planning rank
    priced node by node (:func:`~lamina.auto.pricing.priced_with_spread`), compute from
    ``profile`` at the cluster's rows per rank, collectives on ``comm``; the slowest
    rank's step, with the interval the measured spread gives."""
    axes = tuple(a for a, _ in plans.mesh)
    rows = profile.at_rows(global_rows / plans.world_size)
    priced = [
        priced_with_spread(
            PlanPrices(rows, comm, planned, axes, stage_scale=stage_scale(planned, rows)),
            profile.spread,
        )
        for planned in plans.of(candidate.label)
    ]
    slowest = max(priced, key=lambda p: p[0].step_s)
    low = max(p[1] for p in priced)
    high = max(p[2] for p in priced)
    step = slowest[0].step_s
    return replace(slowest[0], interval_s=(min(low, step), max(high, step)))


__all__ = [
    "PLANS_FILE",
    "PLANS_VERSION",
    "ClusterPlans",
    "planning_ranks",
    "price_on_cluster",
    "read_candidate_plans",
    "stage_scale",
    "with_default_mesh",
]
