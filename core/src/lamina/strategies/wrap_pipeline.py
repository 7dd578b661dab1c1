"""The one sequence every strategy goes through: :func:`distribute_with`.

1. The model is checked: torch.distributed runs, and no strategy holds the model yet.
2. :meth:`~lamina.strategies.contract.Strategy.prepare` returns the model as it runs
   before its plan exists (no collective; most strategies: the model itself). Then
   :meth:`~lamina.strategies.contract.Strategy.plan` plans the step (no collective), at
   once or, for a strategy that
   :meth:`~lamina.strategies.contract.Strategy.plans_at_first_forward`, at that forward
   from its inputs (steps 2-5 run there).
3. ``lamina plan`` / ``lamina verify`` stop here (:mod:`lamina.strategies.preflight`),
   else every rank verifies the plan against the others (unless ``verify=False``).
4. The plan's setup broadcast runs, recorded in the step's run log.
5. :meth:`~lamina.strategies.contract.Strategy.build` returns the distributed model,
   given (with verification on) the means to verify again a plan that run-time facts
   fill in later (``PlannedStep.verify_again``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.coalesced import run_broadcast_nodes
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import (
    Placement,
    PlannedStep,
    StepInputs,
    Strategy,
    StrategyOptions,
)
from lamina.strategies.preflight import before_first_collective, is_planning_only, verify_plan
from lamina.strategies.surface import PLACEMENT_KEY, place_model, role_default
from lamina.verify import PreflightReport

if TYPE_CHECKING:
    from lamina.session import Runtime

#: Set on every distributed model (its ``__dict__``): the strategy's name.
DISTRIBUTED_WITH = "lamina_distributed_with"
#: Plan ``meta`` items every plan set up inside :func:`extra_plan_meta` carries.
_EXTRA_META: list[tuple[str, str]] = []


@contextmanager
def extra_plan_meta(items: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """Every plan set up inside the block carries ``items`` in its ``meta`` (how
    ``"auto"`` records its choice in the plan of the strategy it chose)."""
    _EXTRA_META.extend(items)
    try:
        yield
    finally:
        del _EXTRA_META[len(_EXTRA_META) - len(items) :]


def distribute_with(
    strategy: Strategy,
    model: nn.Module,
    session: Runtime,
    placement: Placement,
    options: StrategyOptions,
    *,
    over: str | None = None,
    verify_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """``model`` distributed with ``strategy`` (see the module docstring); ``over`` names
    the strategy that already holds it when strategies compose (the other axes), and
    ``verify_group`` the ranks whose plans must agree (None: every rank)."""
    _check_distributable(model, strategy.name, over)
    ctx = StrategyContext.of(session)
    held = model.__dict__.get(PLACEMENT_KEY) if over is not None else None

    prepared = model

    def plan_and_build(inputs: StepInputs | None) -> nn.Module:
        measured = strategy.measure(prepared, ctx, placement, options)
        if measured is not None:
            inputs = replace(inputs or StepInputs(), measured=measured)
        planned = strategy.plan(prepared, ctx, placement, options, inputs)
        ready = set_up(session, planned, verify=options.verify, group=verify_group)
        built = strategy.build(ready)
        built.__dict__[DISTRIBUTED_WITH] = strategy.name
        place(built)
        return built

    def place(module: nn.Module) -> None:
        """The strategy's roles and parameter placements added to what ``module``'s
        earlier strategies placed (:mod:`lamina.runtime.placement`)."""
        roles = strategy.roles(placement)
        coordinates = ctx.mesh.coordinates()
        defaults = {a: role_default(r.role, coordinates[a]) for r in roles for a in r.axes}
        given = strategy.place_parameters(module, placement)
        per_param = {n: dict(axes) for n, axes in given.items()}
        place_model(module, ctx.mesh, held, roles, per_param, defaults)

    prepared = strategy.prepare(model, ctx, placement, options, plan_and_build)
    prepared.__dict__[DISTRIBUTED_WITH] = strategy.name
    place(prepared)
    if strategy.plans_at_first_forward(options):
        return prepared
    return plan_and_build(None)


def set_up(
    session: Runtime,
    planned: PlannedStep,
    *,
    verify: bool,
    group: dist.ProcessGroup | None = None,
) -> PlannedStep:
    """``planned`` after stop-or-verify (across ``group``'s ranks; None: every rank) and
    the setup broadcast, with its pre-flight report and run log filled in."""
    if _EXTRA_META:
        held = dict(planned.plan.meta)
        meta = tuple(sorted((*planned.plan.meta, *(i for i in _EXTRA_META if i[0] not in held))))
        planned = replace(planned, plan=replace(planned.plan, meta=meta))
    if is_planning_only():  # "auto" pricing a candidate: the plan, nothing sent
        return replace(planned, run_log=RunLog(planned.plan))
    report = before_first_collective(session, planned, planned.module, verify=verify, group=group)
    log = RunLog(planned.plan)
    setup = planned.broadcast
    if setup is not None:
        run_broadcast_nodes(log, "setup", setup.tensors, setup.source, setup.group)

    def verify_again(filled: ExecutionPlan) -> PreflightReport:
        return verify_plan(session, replace(planned, plan=filled), planned.module, group)

    again = verify_again if verify else None
    return replace(planned, preflight=report, run_log=log, verify_again=again)


def _check_distributable(model: nn.Module, strategy: str, over: str | None = None) -> None:
    """ConfigError unless torch.distributed runs and no strategy holds ``model`` yet (or
    only ``over``, which it composes with)."""
    if not dist.is_initialized():
        raise ConfigError(
            f"strategy {strategy!r} needs torch.distributed; call lamina.init() before distribute()"
        )
    name = type(model).__name__
    held = model.__dict__.get(DISTRIBUTED_WITH)
    if over is not None and held == over:
        return
    if held is None and all(hasattr(type(model), a) for a in ("execution_plan", "step_summary")):
        held = getattr(getattr(model, "execution_plan", None), "strategy", "another strategy")
    if held is not None:
        raise ConfigError(
            f"this {name} is already distributed with {held!r}; distribute the model once, "
            "with one strategy"
        )
