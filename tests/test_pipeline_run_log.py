"""What a pipelined step ran, as its rank records it: one 2-rank job (``pp=2``, a tiny
GPT with its embedding tied to its head, 4 microbatches) runs two steps under each
schedule, and each rank's record is checked against the schedule and the plan: the order
of its stages' compute chunks is the schedule's own (1F1B is not GPipe), every send, recv
and gradient collective the plan gives the rank ran once per step with the plan's bytes,
and gradients accumulated over the two steps are one process's over both batches."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import lamina
from lamina.runtime.nodes import Transfer
from lamina.testing import run_ranks
from models_for_tests import GPT, GPTConfig

pytestmark = [pytest.mark.multiprocess]

VOCAB, BATCH, SEQ, LAYERS, MICROBATCHES = 64, 8, 16, 4, 4
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv")
#: Two batches (inputs, targets), each a step.
BATCHES = ((1, 11), (2, 12))

#: One stage per rank (stage = rank): each stage's chunks in the schedule's order.
#: 1F1B on 2 stages warms up with as many forwards as stages after it, plus one, then
#: alternates a backward and a forward; GPipe runs every forward, then every backward.
SINGLE_STAGE_ORDERS = {
    "gpipe": {0: "F0 F1 F2 F3 B0 B1 B2 B3", 1: "F0 F1 F2 F3 B0 B1 B2 B3"},
    "1f1b": {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"},
}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _build() -> nn.Module:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=LAYERS, n_heads=4)
    return GPT(config)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from _gpt_model import lm_loss

    return lm_loss(out, target)


def _torch_order(schedule: str, stages: list[Any], rank: int) -> list[tuple[str, int, int]]:
    """The compute actions torch's own timetable (``pipeline_order``) gives pipeline rank
    ``rank`` under the multi-stage ``schedule``, built here from torch's class."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    torch_class = {"interleaved1f1b": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}
    table = torch_class[schedule](stages, MICROBATCHES, loss_fn=_loss, scale_grads=False)
    return [
        (a.computation_type.value, a.stage_index, a.microbatch_index)
        for a in table.pipeline_order[rank]
        if a is not None and a.computation_type.value in ("F", "B", "I", "W")
    ]


def _job() -> dict[str, Any]:
    runtime = lamina.init(mesh={"pp": 2})
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        model = lamina.distribute(
            _build(), "pp", example_inputs=(_ids(1),), schedule=schedule,
            microbatches=MICROBATCHES, timing_runs=1,
        )  # fmt: skip
        engine = model.lamina_pp.engine  # type: ignore[union-attr]
        actions = []
        for x, y in BATCHES:  # no zero_grad between: the two steps' gradients add up
            model.step(_ids(x), _ids(y), _loss)  # type: ignore[operator]
            actions.append([tuple(a) for a in engine.last_actions])
        log = model.run_log  # type: ignore[union-attr]
        records = [log.last, log.current]
        out[schedule] = {
            "actions": actions,
            "expected": (
                _torch_order(schedule, engine.pipeline_stages, engine.layout.pipeline_rank)
                if schedule not in SINGLE_STAGE_ORDERS
                else None
            ),
            "stages": model.stages,  # type: ignore[union-attr]
            "plan": model.execution_plan,  # type: ignore[union-attr]
            "records": [
                (dict(r.transfers), dict(r.transfer_bytes), dict(r.issued), r.nbytes)
                for r in records
            ],
            "grads": {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters(remove_duplicate=False)
                if p.grad is not None
            },
        }
    lamina.shutdown()
    return {"rank": runtime.rank, **out}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_job, 2, env=env, timeout=240)


def _expected_actions(result: dict[str, Any], schedule: str) -> list[tuple[str, int, int]]:
    if result[schedule]["expected"] is not None:
        expected: list[tuple[str, int, int]] = result[schedule]["expected"]
        return expected
    rank = result["rank"]
    return [(t[0], rank, int(t[1:])) for t in SINGLE_STAGE_ORDERS[schedule][rank].split()]


def _text(actions: list[tuple[str, int, int]]) -> str:
    return " ".join(f"{kind}{mb}@{stage}" for kind, stage, mb in actions)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_rank_runs_its_stages_chunks_in_the_schedules_own_order(
    results: list[dict[str, Any]], schedule: str
) -> None:
    """``kind microbatch @ stage``: 1F1B's interleaving on each rank, not GPipe's all
    forwards first; interleaved 1F1B and ZBV as torch's own timetable lists them."""
    for result in results:
        want = _expected_actions(result, schedule)
        assert want, (schedule, result["rank"])
        for step, ran in enumerate(result[schedule]["actions"]):
            assert ran == want, (
                f"{schedule!r}, rank {result['rank']}, step {step + 1}: ran "
                f"{_text(ran)}; the schedule's order is {_text(want)}"
            )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_step_records_every_planned_transfer_and_collective_of_its_rank_once(
    results: list[dict[str, Any]], schedule: str
) -> None:
    """Each step's sends and recvs (by the plan's node, with its bytes) and its gradient
    collectives and loss broadcast (by node, with the plan's bytes) are exactly the plan's
    nodes for this rank's stages and groups."""
    for result in results:
        rank, run = result["rank"], result[schedule]
        plan, stages = run["plan"], run["stages"]
        moves = {
            n.id: n.detail.nbytes
            for n in plan.nodes
            if isinstance(n.detail, Transfer) and n.detail.stage in stages
        }
        collectives = {
            n.id: n.collective.nbytes
            for n in plan.collectives()
            if n.phase != "setup" and n.collective is not None and rank in n.collective.group
        }
        assert moves and "pp.loss" in collectives, (schedule, rank, moves, collectives)
        # GPT's embedding (stage 0) and head (the last stage) are tied: summed across the
        # two ranks, except under ZBV, whose rank 0 holds both stages
        tied = [n for n in collectives if n.startswith("pp.tied.")]
        assert len(tied) == (0 if schedule == "zbv" else 1), (schedule, collectives)
        for step, (transfers, moved, issued, nbytes) in enumerate(run["records"]):
            where = f"{schedule!r}, rank {rank}, step {step + 1}"
            assert transfers == dict.fromkeys(moves, 1), f"{where}: sends/recvs {transfers}"
            assert moved == moves, f"{where}: bytes per send/recv {moved}, planned {moves}"
            assert issued == dict.fromkeys(collectives, 1), f"{where}: collectives {issued}"
            assert nbytes == sum(collectives.values()), where


@pytest.fixture(scope="module")
def one_process_grads() -> dict[str, torch.Tensor]:
    """The model's gradients over the two batches in this process: each batch's mean
    loss's backward, accumulated (what two ``model.step`` calls leave before the
    optimizer steps)."""
    model = _build()
    for x, y in BATCHES:
        _loss(model(_ids(x)), _ids(y)).backward()
    return {
        n: p.grad.detach().clone()
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_accumulated_over_two_steps_equal_one_processes(
    results: list[dict[str, Any]], one_process_grads: dict[str, torch.Tensor], schedule: str
) -> None:
    """Two steps without zeroing (each the mean over its microbatches, added to what was
    there, the tied weight summed over its stages once) leave one process's gradients of
    both batches' losses."""
    seen = set()
    for result in results:
        for name, grad in result[schedule]["grads"].items():
            want = one_process_grads[name]
            error = ((grad - want).norm() / want.norm()).item()
            assert error <= 1e-6, (schedule, result["rank"], name, error)
            seen.add(name)
    assert seen == set(one_process_grads), sorted(set(one_process_grads) - seen)
