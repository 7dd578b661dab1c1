"""Strategies from plugins: registered through a real entry point, used by name, isolated
when broken. The plugin here is written against the strategy contract only (``plan`` and
``build``): ``lamina.distribute`` stops it for ``lamina plan``, verifies its plan across
ranks and runs its setup broadcast, and the plugin calls none of those itself."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lamina
from fake_distributions import install_fake_distribution
from lamina.errors import ConfigError, VerificationError
from lamina.plugins import get_registry
from lamina.runtime import ExecutionPlan
from lamina.strategies import strategies
from lamina.testing import run_ranks
from lamina.testing.cli import run_lamina

pytestmark = pytest.mark.portable

SOLO_PLUGIN = """
from dataclasses import dataclass

from torch import nn

from lamina.hookspecs import hookimpl
from lamina.runtime import Compute, ExecutionPlan, PlanNode
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.strategies import Placement, PlannedStep, SetupBroadcast, Strategy, StrategyOptions
from lamina.strategies.coalesced import dtype_totals


@dataclass(frozen=True)
class SoloOptions(StrategyOptions):
    scale: float = 1.0


class Solo(nn.Module):
    def __init__(self, planned, scale):
        super().__init__()
        self.module = planned.module
        self.scale = scale
        self.execution_plan = planned.plan
        self.run_log = planned.log()
        self.preflight = planned.preflight

    def forward(self, x):
        return self.module(x) * self.scale

    def step_summary(self):
        return self.run_log.summary()


class SoloStrategy(Strategy):
    name = "solo"
    summary = "rank 0's weights everywhere, each rank steps alone (a plugin's strategy)"
    options = SoloOptions

    def default_placement(self, mesh):
        return Placement(replicate=mesh.axis_names)

    def plan(self, model, ctx, placement, options, inputs=None):
        params = tuple(model.parameters())
        everyone = tuple(range(ctx.world_size))
        state = dtype_totals(params)
        setup = broadcast_nodes("setup", state, everyone) if len(everyone) > 1 else []
        nodes = (
            *setup,
            PlanNode("forward", "forward", "forward", "forward", Compute()),
            PlanNode("optimizer", "optimizer", "step", "each rank steps alone", Compute()),
        )
        edges = tuple((a.id, b.id) for a, b in zip(nodes, nodes[1:]))
        plan = ExecutionPlan("solo", ctx.world_size, ctx.backend.name, nodes, edges)
        manifest = (("solo", (f"scale={options.scale}",)),)
        return PlannedStep(model, plan, manifest, SetupBroadcast(params), options.scale)

    def build(self, planned):
        return Solo(planned, planned.inputs)


@hookimpl
def lamina_register_strategies():
    return [SoloStrategy()]
"""

SOLO_SCRIPT = """
import torch
from torch import nn
import lamina

lamina.init()
model = lamina.distribute(nn.Linear(4, 2), "solo", scale=2.0)
model(torch.ones(1, 4)).sum().backward()
lamina.shutdown()
"""

CLASHING_PLUGIN = """
from lamina.hookspecs import hookimpl
from lamina.strategies.dp import DataParallelStrategy


@hookimpl
def lamina_register_strategies():
    return [DataParallelStrategy()]  # 'dp' is built in
"""


def _install(site: Path) -> None:
    install_fake_distribution(site, "lamina-solo", "lamina_solo", SOLO_PLUGIN)
    install_fake_distribution(site, "lamina-clash", "lamina_clash", CLASHING_PLUGIN)


@pytest.fixture
def strategy_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    get_registry(reload=True)  # lamina_clean reloads it again afterwards
    return tmp_path


def test_a_plugin_strategy_is_found_through_its_entry_point_and_used_by_name(
    strategy_site: Path,
) -> None:
    lamina.init()
    known = strategies()
    assert list(known)[:3] == ["dp", "zero3", "hsdp"] and "solo" in known
    model = lamina.distribute(nn.Linear(4, 2), "solo", scale=2.0)
    x = torch.ones(3, 4)
    assert torch.equal(model(x), model.module(x) * 2.0)
    assert model.execution_plan.strategy == "solo"  # type: ignore[union-attr]
    assert model.preflight is not None  # lamina.distribute verified it (one rank agrees)
    assert model.run_log.current.issued == {}  # type: ignore[union-attr]  # 1 rank: no broadcast
    with pytest.raises(ConfigError, match="strategy 'solo' has no option 'scal'; its options are"):
        lamina.distribute(nn.Linear(4, 2), "solo", scal=2.0)


def test_a_plugin_reusing_a_builtin_name_is_failed_and_the_builtin_stays(
    strategy_site: Path,
) -> None:
    registry = get_registry()
    known = strategies(registry)
    assert type(known["dp"]).__module__ == "lamina.strategies.dp"
    record = registry.records["lamina-clash"]
    assert record.status == "failed" and record.stage == "hook lamina_register_strategies"
    assert "strategy name 'dp' is already registered" in (record.error or "")
    assert registry.records["lamina-solo"].status == "loaded"


def test_lamina_info_lists_plugin_strategies_and_the_failed_plugin(strategy_site: Path) -> None:
    result = run_lamina("info", "--json", env={"PYTHONPATH": str(strategy_site)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_name = {s["name"]: s for s in report["strategies"]}
    assert list(by_name)[:3] == ["dp", "zero3", "hsdp"]
    assert by_name["solo"]["options"] == ["verify", "scale"]
    assert "bucket_cap_mb" in by_name["dp"]["options"]
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["lamina-clash"]["status"] == "failed"
    assert plugins["lamina-clash"]["stage"] == "hook lamina_register_strategies"


def _distribute_solo(site: str, scale_of_rank: bool) -> dict[str, Any]:
    sys.path.insert(0, site)
    importlib.invalidate_caches()
    get_registry(reload=True)
    runtime = lamina.init()
    torch.manual_seed(runtime.rank)  # rank-seeded: only lamina's broadcast makes them equal
    module = nn.Linear(4, 2)
    scale = float(runtime.rank + 1) if scale_of_rank else 2.0
    try:
        model = lamina.distribute(module, "solo", scale=scale)
    except VerificationError as error:
        return {"refused": str(error).splitlines()[0], "detail": str(error)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [p.detach().clone() for p in model.parameters()])
    return {
        "equal_on_ranks": all(
            torch.equal(a, b) for a, b in zip(gathered[0], gathered[1], strict=True)
        ),
        "issued": dict(model.run_log.current.issued),
        "verified": model.preflight is not None,
    }


@pytest.mark.multiprocess
def test_distribute_verifies_and_broadcasts_a_plugin_strategys_plan(tmp_path: Path) -> None:
    _install(tmp_path)
    for result in run_ranks(_distribute_solo, 2, args=(str(tmp_path), False), timeout=120):
        assert result == {
            "equal_on_ranks": True,
            "issued": {"setup.broadcast.float32": 1},
            "verified": True,
        }


@pytest.mark.multiprocess
def test_distribute_refuses_a_plugin_plan_the_ranks_disagree_on(tmp_path: Path) -> None:
    _install(tmp_path)
    for result in run_ranks(_distribute_solo, 2, args=(str(tmp_path), True), timeout=120):
        assert "pre-flight verification failed" in result["refused"], result
        assert "scale=1.0" in result["detail"] and "scale=2.0" in result["detail"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_lamina_plan_stops_a_plugin_strategy_before_its_first_collective(
    strategy_site: Path,
) -> None:
    script = strategy_site / "solo_script.py"
    script.write_text(SOLO_SCRIPT)
    env = {"PYTHONPATH": str(strategy_site), "LAMINA_BACKEND": "cpu"}
    result = run_lamina("plan", "--json", "--nproc-per-node", "2", str(script), env=env)
    assert result.returncode == 0, result.stderr
    plan = ExecutionPlan.from_dict(json.loads(result.stdout))
    assert plan.strategy == "solo" and plan.world_size == 2
    assert [n.id for n in plan.collectives()] == ["setup.broadcast.float32"]
