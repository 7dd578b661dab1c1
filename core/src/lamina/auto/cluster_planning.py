"""A planning process standing as one rank of a declared cluster:
:func:`join_as_cluster_rank`, then :func:`write_candidate_plans`.

``lamina plan --simulate CLUSTER --auto`` ranks candidates for a cluster this job is
not; each candidate is planned by a planning process that stands as one rank of it
(one process, not under torchrun: :func:`lamina.cli.plan.plan_as_cluster_ranks` starts
one per :func:`~lamina.auto.cluster_plans.planning_ranks`): torch's fake process group
of the cluster's world size (backend ``"fake"``: every collective returns at once and
moves no data; planning issues none of the step's anyway), the cluster's devices as the
topology (host by host), its mesh as the mesh. The strategies plan there as they would
on that rank of the cluster (:func:`lamina.auto.plans.plan_candidate`: bucket and unit
sizes, each collective's group and bytes, a pipeline's stages and schedule), and the
plans are written to a folder, with the reason for each candidate its strategies
refuse, for the ranking job to price (:mod:`lamina.auto.cluster_plans`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.distributed import HashStore  # type: ignore[attr-defined]

from lamina.auto.choose import (
    AUTO,
    AutoOptions,
    candidates_of,
    distribution_for,
    global_rows_of,
)
from lamina.auto.cluster_plans import PLANS_FILE, PLANS_VERSION, with_default_mesh
from lamina.auto.plans import plan_candidate
from lamina.device.topology import DeviceInfo, FastDomain, Topology
from lamina.errors import ConfigError

if TYPE_CHECKING:
    from lamina.session import Runtime
    from lamina.simulate.cluster import Cluster


def cluster_topology(cluster: Cluster, device_type: str) -> Topology:
    """The cluster's devices as a topology: host ``h`` holds ranks ``h*L .. h*L+L-1``,
    one fast domain per host (its links are the cluster file's business, not the
    plan's)."""
    per_host = cluster.devices_per_host
    devices = tuple(
        DeviceInfo(rank, rank % per_host, f"host{rank // per_host}", device_type, 0)
        for rank in range(cluster.world_size)
    )
    domains = tuple(
        FastDomain(f"host{h}", tuple(range(h * per_host, (h + 1) * per_host)))
        for h in range(cluster.hosts)
    )
    return Topology(devices, fast_domains=domains)


def join_as_cluster_rank(cluster: Cluster, rank: int, backend: str | None = None) -> Runtime:
    """Initialize this process as rank ``rank`` of ``cluster`` on torch's fake process
    group (see the module) and return lamina's runtime there; a training script's own
    ``lamina.init`` then returns it. For a planning process only: nothing it computes
    after a collective is data."""
    from lamina.session import init

    if dist.is_initialized():
        raise ConfigError(
            "a planning process must start without a process group; run it alone "
            "(python -m lamina.cli.rank_runner --as-cluster-rank), not under torchrun"
        )
    cluster = with_default_mesh(cluster)
    if not 0 <= rank < cluster.world_size:
        raise ConfigError(
            f"rank {rank} is outside the {cluster.world_size}-device cluster "
            f"{cluster.source}; plan as a rank in 0..{cluster.world_size - 1}"
        )
    _register_fake_backend()
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(cluster.world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"
    )
    dist.init_process_group("fake", store=HashStore(), rank=rank, world_size=cluster.world_size)
    from lamina.plugins import get_registry

    device_type = get_registry().select_backend(backend).device_type
    return init(backend, topology=cluster_topology(cluster, device_type), mesh=dict(cluster.mesh))


def _register_fake_backend() -> None:
    """torch lists ``fake`` among its backends and registers its constructor in the
    module that defines it (importing it registers it)."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
    except ImportError as missing:  # pragma: no cover - present in every torch lamina supports
        raise ConfigError(
            f"this torch has no fake process group ({missing}); install torch >= 2.4 to "
            "rank candidates for a declared cluster"
        ) from None


def write_candidate_plans(
    model: nn.Module, runtime: Runtime, options: Mapping[str, Any], folder: str | Path
) -> Path:
    """Plan every candidate of ``runtime``'s mesh for ``model`` (its strategies as
    ``"auto"`` would apply them, nothing distributed) and write them, with the reason for
    each one refused, to ``folder``/:data:`PLANS_FILE`."""
    opts = AutoOptions.from_kwargs(AUTO, options)
    inputs = opts.example_inputs
    assert inputs is not None
    axes = tuple((a, runtime.mesh.size(a)) for a in runtime.mesh.axis_names)
    candidates = candidates_of(axes, opts)
    rows = global_rows_of(opts, runtime.world_size)
    records: dict[str, Any] = {}
    for candidate in candidates:
        given = distribution_for(
            candidate, inputs, opts.example_kwargs, verify=False, global_rows=rows
        )
        try:
            planned = plan_candidate(
                model, candidate, given, runtime, inputs, opts.example_kwargs, global_rows=rows
            )
        except ConfigError as refused:
            records[candidate.label] = {"refused": str(refused)}
            continue
        records[candidate.label] = {
            "plan": planned.plan.to_dict(),
            "parts": [p.to_dict() for p in planned.parts],
            "held_numel": planned.held_numel,
            "dtensors": planned.dtensors,
        }
    data = {
        "version": PLANS_VERSION,
        "rank": runtime.rank,
        "world_size": runtime.world_size,
        "mesh": [list(a) for a in axes],
        "global_rows": rows,
        "candidates": records,
    }
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLANS_FILE.format(rank=runtime.rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


__all__ = ["cluster_topology", "join_as_cluster_rank", "write_candidate_plans"]
