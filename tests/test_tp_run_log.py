"""Tensor parallelism runs its plan: after a training step the run log holds exactly the
plan's activation collectives (each node once, its bytes), and every collective tp hands
``torch.distributed`` on its group went through the log. ``tp`` alone on 2 ranks and
``["tp", "zero3"]`` on a 2 x 2 mesh, the tiny GPT and Llama, with and without sequence
parallelism; one job per rank count serves every case."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lamina
from lamina.testing import WireCounter, run_ranks
from lamina.testing.plan_check import collectives_against_plan
from models_for_tests import tiny_gpt, tiny_llama

VOCAB, BATCH, SEQ = 64, 2, 16
#: Each model with sequence parallelism on and off.
CASES = [("gpt", True), ("gpt", False), ("llama", True), ("llama", False)]


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _train_step(model: nn.Module, seed: int) -> None:
    out = model(_ids(seed))
    logits = out.logits if hasattr(out, "logits") else out
    F.cross_entropy(logits.reshape(-1, VOCAB), _ids(seed + 1).reshape(-1)).backward()


def _two_steps(strategies: Any, name: str, sp: bool) -> dict[str, Any]:
    """Two training steps of ``name``; what the tp run log recorded of each against the
    model's plan, and what crossed the wire on the tp group in the second."""
    torch.manual_seed(0)
    model = tiny_gpt() if name == "gpt" else tiny_llama(0)
    model = lamina.distribute(model, strategies, example_inputs=(_ids(0),), sequence_parallel=sp)
    tp = model.lamina_tp  # type: ignore[union-attr]
    plan = model.execution_plan  # type: ignore[union-attr]
    group = next(n.collective.group for n in plan.collectives() if n.id.endswith(".fwd"))  # type: ignore[union-attr]
    _train_step(model, 1)
    with WireCounter() as wire:
        _train_step(model, 3)
    first, second = tp.run_log.last, tp.run_log.current
    return {
        "sequence_parallel": dict(plan.meta).get("sequence_parallel"),
        "first": collectives_against_plan(plan, first, prefix="tp."),
        "second": collectives_against_plan(plan, second, prefix="tp."),
        "steps": (first.step, second.step),
        "synced": (first.synced, second.synced),
        "logged": (sum(second.issued.values()), second.nbytes),
        "wire": (wire.calls(group=group), wire.bytes(group=group)),
        "planned": sum(
            1 for n in plan.collectives() if n.id.startswith("tp.") and n.phase != "setup"
        ),
    }


def _cases(strategies: Any, mesh: dict[str, int]) -> dict[str, Any]:
    lamina.init(mesh=mesh)
    results: dict[str, Any] = {}
    for name, sp in CASES:
        try:
            results[f"{name}/{sp}"] = _two_steps(strategies, name, sp)
        except Exception as err:  # every rank raises alike: the next case still runs
            results[f"{name}/{sp}"] = {"error": f"{type(err).__name__}: {err}"}
    lamina.shutdown()
    return results


def _tp_alone_job() -> dict[str, Any]:
    return _cases("tp", {"tp": 2})


def _tp_zero3_job() -> dict[str, Any]:
    return _cases(["tp", "zero3"], {"fsdp": 2, "tp": 2})


@pytest.fixture(scope="module")
def tp_alone() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_tp_alone_job, 2, env=env, timeout=200)


@pytest.fixture(scope="module")
def tp_zero3() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_tp_zero3_job, 4, env=env, timeout=200)


def _check(results: list[dict[str, Any]], name: str, sp: bool) -> None:
    for rank, by_case in enumerate(results):
        got = by_case[f"{name}/{sp}"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        for step in ("first", "second"):
            differences = "\n  ".join(got[step])
            assert not got[step], (
                f"rank {rank}, {step} step ran otherwise than planned:\n  {differences}"
            )
        assert got["sequence_parallel"] == str(sp)  # the plan says what was asked
        assert got["steps"][1] == got["steps"][0] + 1  # each training forward opens a step
        assert got["synced"] == (True, True)  # each backward ended in the log
        assert got["logged"][0] == got["planned"]
        assert got["wire"] == got["logged"], (rank, "calls and bytes on the tp group vs the log")


def test_the_plan_check_names_each_collective_missing_unplanned_or_of_other_bytes() -> None:
    from lamina.runtime.log import StepRecord
    from lamina.strategies.tp.derive import derive_plan
    from lamina.strategies.tp.plan_nodes import build_tensor_plan

    model = tiny_gpt()
    layers = derive_plan(model, (_ids(0),), None, 2, sequence_parallel=True)
    plan = build_tensor_plan(layers, model, (0, 1), "tp", 2, "gloo")
    step = [n for n in plan.collectives() if n.phase in ("forward", "backward")]
    ran = StepRecord(1, Counter(n.id for n in step), sum(n.collective.nbytes for n in step))  # type: ignore[union-attr]
    assert collectives_against_plan(plan, ran) == []
    assert "tp.blocks.0.attn.proj.bias" in ran.issued  # added on sequence slices: summed
    gather = plan.node("tp.blocks.0.attn.gather")
    ran.issued[gather.id] -= 1
    ran.issued["tp.setup.broadcast.float32"] = 1
    ran.issued["setup.broadcast.float32"] = 1
    assert collectives_against_plan(plan, ran, prefix="tp.") == [
        "tp.blocks.0.attn.gather (forward all_gather on tp, 4096 B): planned 1x, issued 0x",
        "tp.setup.broadcast.float32: issued 1x in the step, not a node of the plan",
    ]
    lines = collectives_against_plan(plan, ran)
    assert "setup.broadcast.float32: issued 1x in the step, a setup node of the plan" in lines
    del ran.issued["tp.setup.broadcast.float32"], ran.issued["setup.broadcast.float32"]
    ran.issued[gather.id] += 1
    ran.nbytes += 4
    assert collectives_against_plan(plan, ran) == [
        f"bytes: the step moved {ran.nbytes} B, its plan nodes say {ran.nbytes - 4} B for "
        f"the same {len(step)} collectives"
    ]


@pytest.mark.timeout(250)
@pytest.mark.parametrize(("name", "sp"), CASES)
def test_a_tp_step_issues_exactly_the_plans_collectives(
    tp_alone: list[dict[str, Any]], name: str, sp: bool
) -> None:
    _check(tp_alone, name, sp)


@pytest.mark.timeout(250)
@pytest.mark.parametrize(("name", "sp"), CASES)
def test_a_tp_by_zero3_step_issues_exactly_the_plans_tp_collectives(
    tp_zero3: list[dict[str, Any]], name: str, sp: bool
) -> None:
    _check(tp_zero3, name, sp)
