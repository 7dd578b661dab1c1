"""What a step runs is what its plan says, for every strategy and composition: one
training step's collectives, as each strategy's run log recorded them, against that
strategy's plan nodes (op, mesh axis, bytes, count; :mod:`lamina.testing.plan_check`).
tp and pp alone, with their transfers and chunk order, are in tests/test_tp_run_log.py
and tests/test_pipeline_run_log.py."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import lamina
from lamina.testing import run_ranks
from lamina.testing.plan_check import collectives_against_plan
from models_for_tests import tiny_gpt

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ, ROWS = 64, 16, 4


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from _gpt_model import lm_loss

    return lm_loss(out, target)


def _logs(model: torch.nn.Module) -> dict[str, Any]:
    """Each strategy holding ``model``: (its plan, its run log)."""
    held = {
        "dp": model.__dict__.get("lamina_dp"),
        "tp": model.__dict__.get("lamina_tp"),
        "pp": model.__dict__.get("lamina_pp"),
        "sharder": model.__dict__.get("lamina_sharding"),
    }
    return {k: (s.execution_plan, s.run_log) for k, s in held.items() if s is not None}


def _second_step(strategy: Any, rank: int, pipelined: bool = False) -> dict[str, Any]:
    """Two training steps of the GPT under ``strategy``; each strategy's differences
    between its record of the second step and its plan (none when it ran the plan)."""
    torch.manual_seed(0)
    options: dict[str, Any] = {}
    if pipelined:
        options = {"example_inputs": (_ids(0),), "timing_runs": 1, "microbatches": 2}
    elif not isinstance(strategy, str) or strategy == "tp":
        options = {"example_inputs": (_ids(0),)}
    model = lamina.distribute(tiny_gpt(), strategy, **options)
    for step in range(2):
        if pipelined:
            model.step(_ids(step), _ids(step + 100), _loss)  # type: ignore[operator]
        else:
            _loss(model(_ids(step)), _ids(step + 100)).backward()
        model.zero_grad(set_to_none=True)
    out = {}
    for name, (plan, log) in _logs(model).items():
        record = log.current
        out[name] = {
            "step": record.step,
            "issued": sum(record.issued.values()),
            "differences": collectives_against_plan(plan, record, rank=rank),
        }
    return out


def _data_job() -> dict[str, Any]:
    runtime = lamina.init(mesh={"inter": 2, "intra": 2})
    out = {s: _second_step(s, runtime.rank) for s in ("dp", "zero3", "hsdp")}
    lamina.shutdown()
    return out


def _split_job() -> dict[str, Any]:
    runtime = lamina.init(mesh={"dp": 2, "fsdp": 1, "tp": 2})
    out = {
        "+".join(c): _second_step(list(c), runtime.rank) for c in (("tp", "zero3"), ("tp", "hsdp"))
    }
    lamina.shutdown()
    return out


def _pipeline_job() -> dict[str, Any]:
    runtime = lamina.init(mesh={"pp": 2, "dp": 2})
    out = {
        "+".join(c): _second_step(list(c), runtime.rank, pipelined=True)
        for c in (("pp",), ("pp", "zero3"))
    }
    lamina.shutdown()
    return out


JOBS = {"data": _data_job, "split": _split_job, "pipeline": _pipeline_job}
#: (job, strategy, the strategies holding the model whose logs are compared)
CASES = [
    ("data", "dp", ("dp",)),
    ("data", "zero3", ("sharder",)),
    ("data", "hsdp", ("sharder",)),
    ("split", "tp+zero3", ("tp", "sharder")),
    ("split", "tp+hsdp", ("tp", "sharder")),
    ("pipeline", "pp", ("pp",)),
    ("pipeline", "pp+zero3", ("pp", "sharder")),
]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return {name: run_ranks(job, 4, env=env, timeout=300) for name, job in JOBS.items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("job", "strategy", "holders"), CASES)
def test_a_step_issues_exactly_its_plans_collectives(
    results: dict[str, list[dict[str, Any]]], job: str, strategy: str, holders: tuple[str, ...]
) -> None:
    for rank, result in enumerate(results[job]):
        got = result[strategy]
        assert sorted(got) == sorted(holders), (rank, strategy, sorted(got))
        for holder in holders:
            record = got[holder]
            assert record["differences"] == [], (rank, strategy, holder, record["differences"])
            assert record["step"] >= 1, (rank, strategy, holder, "the second step opened no record")
    # something ran: a strategy that records nothing would pass the comparison vacuously
    assert any(results[job][0][strategy][h]["issued"] for h in holders)
