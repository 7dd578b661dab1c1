"""What every strategy does between planning and its first collective.

:func:`lamina.distribute` (:mod:`lamina.strategies.wrap_pipeline`) calls
:func:`before_first_collective` once per model, with the session, the strategy's
:class:`~lamina.strategies.contract.PlannedStep` and the module. That runs
the pre-flight cross-rank verification (:func:`lamina.verify.preflight`) unless the
strategy was given ``verify=False``, with the manifest items the strategy contributes.

``lamina plan`` and ``lamina verify`` run the user's script through a rank runner
(:mod:`lamina.cli.rank_runner`) that first calls :func:`request_stop`: the strategy then
raises :class:`StopBeforeFirstCollective` carrying its plan (``"plan"``), or the passed
verification (``"verify"``), and the runner reports it. Nothing here ends the process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import torch.distributed as dist
from torch import nn

from lamina.runtime import ExecutionPlan
from lamina.strategies.contract import PlannedStep
from lamina.verify import Manifest, PreflightReport, build_manifest, preflight

if TYPE_CHECKING:
    from lamina.session import Runtime

StopAt = Literal["plan", "verify"]

_STOP: StopAt | None = None
#: Inside :func:`planning_only`: plans are built without their setup collectives.
_PLANNING_ONLY: list[bool] = []


class StopBeforeFirstCollective(BaseException):
    """Raised out of the user's script when the launcher asked to stop before the first
    collective. A ``BaseException``, so that a script's ``except Exception`` lets it by."""

    def __init__(self, plan: ExecutionPlan, report: PreflightReport | None = None) -> None:
        super().__init__(f"stopped before the first collective of a {plan.strategy} plan")
        self.plan = plan
        self.report = report


def request_stop(at: StopAt | None) -> None:
    """Make the next strategy that plans stop there: ``"plan"`` right after planning,
    ``"verify"`` after the pre-flight check; ``None`` cancels the request."""
    global _STOP
    if at not in (None, "plan", "verify"):
        raise ValueError(f"request_stop takes 'plan', 'verify' or None, got {at!r}")
    _STOP = at


@contextmanager
def planning_only() -> Iterator[None]:
    """Strategies distributed inside the block plan and build without a collective of
    their own: no pre-flight check and no setup broadcast (the model's values are not
    made alike). What ``"auto"`` plans each candidate on a copy of the model with."""
    _PLANNING_ONLY.append(True)
    try:
        yield
    finally:
        _PLANNING_ONLY.pop()


def is_planning_only() -> bool:
    """Whether a :func:`planning_only` block is open."""
    return bool(_PLANNING_ONLY)


def before_first_collective(
    runtime: Runtime,
    planned: PlannedStep,
    module: nn.Module,
    *,
    verify: bool,
    group: dist.ProcessGroup | None = None,
) -> PreflightReport | None:
    """Stop here for ``lamina plan``, or verify the plan across the ranks of ``group``
    (None: every rank; see the module)."""
    if _STOP == "plan":
        raise StopBeforeFirstCollective(planned.plan)
    if not (verify or _STOP == "verify"):
        return None
    report = verify_plan(runtime, planned, module, group)
    if _STOP == "verify":
        raise StopBeforeFirstCollective(planned.plan, report)
    return report


def verify_plan(
    runtime: Runtime,
    planned: PlannedStep,
    module: nn.Module,
    group: dist.ProcessGroup | None = None,
) -> PreflightReport:
    """Every rank's manifest of ``planned`` compared with the others' (collective over
    ``group``, by default the control group: every rank); a VerificationError naming what
    differs. A strategy composed after ``pp`` passes its own axes' group: the stages
    differ by design, the ranks holding one stage must agree."""
    manifest = manifest_of(runtime, planned, module)
    return preflight(manifest, group=group if group is not None else runtime.control_group)


def manifest_of(runtime: Runtime, planned: PlannedStep, module: nn.Module) -> Manifest:
    """This rank's pre-flight manifest: the job (world with its hosts, backend, mesh), the
    module's parameters, the strategy's own items and the plan's collective sequence."""
    manifest = build_manifest(
        runtime.rank,
        world_size=runtime.world_size,
        backend=runtime.backend.name,
        collective_backend=runtime.backend.collective_backend,
        mesh=runtime.mesh.lines(),
        module=module,
        extra=planned.manifest,
        leading=planned.leading_manifest,
        plan_lines=planned.plan.collective_sequence(),
    )
    topology = runtime.topology
    hosts = tuple(f"host {h}: ranks {topology.ranks_on_host(h)}" for h in topology.hosts())
    return Manifest(
        runtime.rank,
        tuple(
            (name, lines + hosts if name == "world" else lines) for name, lines in manifest.items
        ),
    )
