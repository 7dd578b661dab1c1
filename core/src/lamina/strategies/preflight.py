"""What a strategy does between planning and its first collective.

1. ``$LAMINA_PLAN_OUT`` set (``lamina plan``): write the plan as JSON to that folder
   (``plan.json`` from rank 0) and stop the script with exit status 0, before any
   collective.
2. Pre-flight verification (:func:`lamina.verify.preflight`) across all ranks, unless
   the strategy was given ``verify=False``.
3. ``$LAMINA_VERIFY_ONLY=1`` (``lamina verify``): print ``OK`` or the difference and stop
   (status 0 or 3).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from torch import nn

from lamina.errors import ConfigError, VerificationError
from lamina.graph import CapturedGraph
from lamina.memory.layout import ShardLayout
from lamina.runtime import ExecutionPlan
from lamina.verify import Manifest, PreflightReport, build_manifest, preflight

PLAN_OUT_ENV = "LAMINA_PLAN_OUT"
VERIFY_ONLY_ENV = "LAMINA_VERIFY_ONLY"
#: Exit status of a ``lamina verify`` run that found a difference.
VERIFY_FAILED_STATUS = 3

logger = logging.getLogger("lamina.strategies")


def write_plan(plan: ExecutionPlan, folder: str, rank: int) -> Path:
    """Write ``plan.json`` (rank 0) or ``plan.rank<N>.json`` into ``folder``."""
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{PLAN_OUT_ENV}={folder!r} cannot be created ({exc}); pick a writable folder"
        ) from None
    path = out / ("plan.json" if rank == 0 else f"plan.rank{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(plan.to_json() + "\n")
    tmp.replace(path)
    return path


def before_first_collective(
    plan: ExecutionPlan,
    module: nn.Module,
    *,
    verify: bool,
    graph: CapturedGraph | None = None,
    layout: ShardLayout | None = None,
) -> PreflightReport | None:
    """Write the plan and stop (``lamina plan``), or verify it across ranks."""
    from lamina.session import current

    runtime = current()
    rank = runtime.rank if runtime is not None else 0
    plan_out = os.environ.get(PLAN_OUT_ENV)
    if plan_out:
        path = write_plan(plan, plan_out, rank)
        logger.info("wrote the execution plan to %s; stopping before step 1", path)
        _stop(0)
    verify_only = os.environ.get(VERIFY_ONLY_ENV, "") not in ("", "0")
    if runtime is None or not (verify or verify_only):
        return None
    manifest = build_manifest(
        rank,
        world_size=runtime.world_size,
        backend=runtime.backend.name,
        collective_backend=runtime.backend.collective_backend,
        mesh_shape=runtime.mesh.shape,
        mesh_names=runtime.mesh.axis_names,
        module=module,
        graph=graph,
        layout=layout,
        plan_lines=plan.collective_sequence(),
    )
    topology = runtime.topology
    hosts = [f"{h}: ranks {topology.ranks_on_host(h)}" for h in topology.hosts()]
    manifest = Manifest(
        rank,
        tuple(
            (name, lines + tuple(f"host {h}" for h in hosts) if name == "world" else lines)
            for name, lines in manifest.items
        ),
    )
    try:
        report = preflight(manifest, group=runtime.control_group)
    except VerificationError as exc:
        if verify_only:
            print(f"lamina verify: rank {rank}: FAILED: {exc}", file=sys.stderr, flush=True)
            _stop(VERIFY_FAILED_STATUS)
        raise
    if verify_only:
        if rank == 0:
            print(f"lamina verify: OK: {report.summary()}", flush=True)
        _stop(0)
    return report


def _stop(status: int) -> NoReturn:
    """End the script here with ``status``, without interpreter teardown: destroying a
    gloo group while a peer process is already gone can abort (SIGABRT) instead of
    exiting with the status ``lamina plan`` / ``lamina verify`` report. No collective of
    the job has run yet, so there is nothing to finish."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
