"""Pipeline parallelism on models written as people train them today
(:mod:`modern_models`: the fused Llama with its blocks in an ``nn.ModuleDict``,
transformers' Qwen3 and Qwen3-MoE): pp=2 x dp=2 and pp=2 x dp=2 x tp=2 (8 ranks, tensor
parallelism inside each stage, attention split by heads) train as one process does.

A file of its own so that it runs beside ``test_pipeline.py``'s jobs, whose helpers it
uses."""

from __future__ import annotations

import os
from typing import Any

import pytest

import lamina
from lamina.testing import run_ranks
from test_pipeline import _check, _train_once, check_attention_split

pytestmark = [pytest.mark.multiprocess]

#: pp=2 x dp=2: each model once, a schedule each, both optimizers.
PP_DP_CASES = [
    ("fused", "1f1b", "adamw"),
    ("qwen3", "gpipe", "sgd"),
    ("moe", "1f1b", "adamw"),
]
#: pp=2 x dp=2 x tp=2: each model once, tp inside the stages, replicated over dp.
PP_TP_CASES = [
    ("fused", "1f1b", "adamw"),
    ("qwen3", "interleaved1f1b", "sgd"),
    ("moe", "gpipe", "adamw"),
]


def _job(mesh: dict[str, int], strategy: Any, cases: list[tuple[str, str, str]]) -> Any:
    runtime = lamina.init(mesh=mesh)
    out = {f"{n}/{s}/{o}": _train_once(runtime, n, s, o, strategy) for n, s, o in cases}
    lamina.shutdown()
    return out


def _env() -> dict[str, str]:
    return {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}


@pytest.fixture(scope="module")
def pp_dp_results() -> list[dict[str, Any]]:
    args = ({"pp": 2, "dp": 2}, "pp", PP_DP_CASES)
    return run_ranks(_job, 4, args=args, env=_env(), timeout=600)


@pytest.fixture(scope="module")
def pp_tp_results() -> list[dict[str, Any]]:
    args = ({"pp": 2, "dp": 2, "tp": 2}, ["pp", "tp"], PP_TP_CASES)
    return run_ranks(_job, 8, args=args, env=_env(), timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("name", "schedule", "optimizer"), PP_DP_CASES)
def test_pp_by_dp_on_todays_models_trains_as_one_process(
    pp_dp_results: list[dict[str, Any]], name: str, schedule: str, optimizer: str
) -> None:
    _check(pp_dp_results, f"{name}/{schedule}/{optimizer}")


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("name", "schedule", "optimizer"), PP_TP_CASES)
def test_pp_by_tp_on_todays_models_trains_as_one_process_with_attention_split_by_heads(
    pp_tp_results: list[dict[str, Any]], name: str, schedule: str, optimizer: str
) -> None:
    key = f"{name}/{schedule}/{optimizer}"
    _check(pp_tp_results, key, strategy="pp+tp")
    check_attention_split(pp_tp_results, key)
