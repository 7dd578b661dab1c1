"""Strategies from plugins: registered through a real entry point, used by name, isolated
when broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lamina
from fake_distributions import install_fake_distribution
from lamina.errors import ConfigError
from lamina.plugins import get_registry
from lamina.strategies import strategies
from lamina.testing.cli import run_lamina

pytestmark = pytest.mark.portable

SOLO_PLUGIN = """
from dataclasses import dataclass

from torch import nn

from lamina.hookspecs import hookimpl
from lamina.runtime import Compute, ExecutionPlan, PlanNode, RunLog
from lamina.strategies import Placement, PlannedStep, Strategy, StrategyOptions
from lamina.strategies.preflight import before_first_collective


@dataclass(frozen=True)
class SoloOptions(StrategyOptions):
    scale: float = 1.0


class Solo(nn.Module):
    def __init__(self, module, runtime, options):
        super().__init__()
        self.module = module
        self.scale = options.scale
        nodes = (
            PlanNode("forward", "forward", "forward", "forward", Compute()),
            PlanNode("optimizer", "optimizer", "step", "each rank steps alone", Compute()),
        )
        self.execution_plan = ExecutionPlan(
            "solo", runtime.world_size, runtime.backend.name, nodes, (("forward", "optimizer"),)
        )
        self.run_log = RunLog(self.execution_plan)
        planned = PlannedStep(self.execution_plan, (("solo", (f"scale={self.scale}",)),))
        self.preflight = before_first_collective(runtime, planned, module, verify=options.verify)

    def forward(self, x):
        return self.module(x) * self.scale

    def step_summary(self):
        return self.run_log.summary()


class SoloStrategy(Strategy):
    name = "solo"
    summary = "every rank trains on its own (a plugin's strategy)"
    options = SoloOptions

    def default_placement(self, mesh):
        return Placement(replicate=mesh.axis_names)

    def wrap(self, model, runtime, placement, options):
        return Solo(model, runtime, options)


@hookimpl
def lamina_register_strategies():
    return [SoloStrategy()]
"""

CLASHING_PLUGIN = """
from lamina.hookspecs import hookimpl
from lamina.strategies.dp import DataParallelStrategy


@hookimpl
def lamina_register_strategies():
    return [DataParallelStrategy()]  # 'dp' is built in
"""


@pytest.fixture
def strategy_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    install_fake_distribution(tmp_path, "lamina-solo", "lamina_solo", SOLO_PLUGIN)
    install_fake_distribution(tmp_path, "lamina-clash", "lamina_clash", CLASHING_PLUGIN)
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
