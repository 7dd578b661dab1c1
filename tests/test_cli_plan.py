"""``lamina plan`` and ``lamina verify`` on real scripts, launched through torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lamina.runtime import ExecutionPlan
from lamina.testing.cli import run_lamina

pytestmark = [pytest.mark.portable, pytest.mark.multiprocess]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MLP = str(EXAMPLES / "train_mlp.py")
ENV = {"LAMINA_BACKEND": "cpu", "LAMINA_VERIFY_TIMEOUT": "20"}

ODD_RANK_SCRIPT = """
import os
import torch
from torch import nn
import lamina

lamina.init()
width = 48 if os.environ["RANK"] == "1" else 32
model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))
model = lamina.distribute(model, "dp")
model(torch.randn(4, 16)).sum().backward()
lamina.shutdown()
"""

NO_DISTRIBUTE_SCRIPT = "print('this script trains nothing')\n"


@pytest.mark.timeout(120)
def test_plan_explain_for_one_rank() -> None:
    result = run_lamina("plan", "--explain", MLP, "--steps", "1", env=ENV)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "execution plan: dp on cpu, 1 rank(s)" in out
    assert "collective sequence" in out and "(none: one rank)" in out
    assert "capture:export -> capture:fx" in out
    assert "the plan is identical on all 1 rank(s)" in out
    assert "loss" not in out  # stopped before training


@pytest.mark.timeout(120)
def test_plan_json_for_two_ranks_zero3() -> None:
    result = run_lamina(
        "plan", "--json", "--nproc-per-node", "2", MLP, "--strategy", "zero3", env=ENV
    )
    assert result.returncode == 0, result.stderr
    plan = ExecutionPlan.from_dict(json.loads(result.stdout))
    assert plan.strategy == "zero3" and plan.world_size == 2
    ops = [n.collective.op for n in plan.collectives() if n.collective]
    # the wrap-time broadcast, then gloo's forms: a broadcast per rank, all_to_all
    assert ops[0] == "broadcast" and "all_to_all" in ops and "all_reduce" not in ops
    assert any(f.taken and "gloo" in f.reason for f in plan.fallbacks)


@pytest.mark.timeout(120)
def test_verify_ok_on_two_ranks() -> None:
    result = run_lamina("verify", "--nproc-per-node", "2", MLP, env=ENV)
    assert result.returncode == 0, result.stderr
    assert "lamina verify: OK: pre-flight verification: 2 ranks agree" in result.stdout


@pytest.mark.timeout(120)
def test_verify_reports_the_difference(tmp_path: Path) -> None:
    script = tmp_path / "odd_rank.py"
    script.write_text(ODD_RANK_SCRIPT)
    result = run_lamina("verify", "--nproc-per-node", "2", str(script), env=ENV)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "FAILED: pre-flight verification failed: rank(s) [1] differ from rank 0" in (
        result.stderr
    )
    assert "[48, 16]" in result.stderr and "[32, 16]" in result.stderr


@pytest.mark.timeout(120)
def test_plan_of_a_script_without_distribute(tmp_path: Path) -> None:
    script = tmp_path / "nothing.py"
    script.write_text(NO_DISTRIBUTE_SCRIPT)
    result = run_lamina("plan", str(script), env=ENV)
    assert result.returncode == 2
    assert "without building an execution plan" in result.stderr


def test_plan_of_a_missing_script() -> None:
    result = run_lamina("plan", "no/such/script.py", env=ENV)
    assert result.returncode == 2
    assert "does not exist" in result.stderr
