"""Pre-flight verification inside ``lamina.distribute``: mismatches fail on every rank.

Each job injects one difference on rank 1 and checks that every rank that reached the
verifier raises the same one-line diff (naming rank 1, the category and both values)
instead of hanging in the first collective; every job is bounded in time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lamina
from lamina.errors import VerificationError
from lamina.testing import run_ranks

VERIFY_ENV = {"LAMINA_VERIFY_TIMEOUT": "8"}


def _model(width: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4)).to(dtype)


def _mismatch_job(kind: str, strategy: str) -> dict[str, Any]:
    """One rank of a job where rank 1 differs as ``kind`` says; returns what happened."""
    mesh: Any = ((2,), ("data",)) if kind == "mesh" and _rank() == 1 else "flat"
    runtime = lamina.init(backend="cpu", mesh=mesh)
    odd = runtime.rank == 1
    width = 48 if kind == "wider" and odd else 32
    dtype = torch.float64 if kind == "dtype" and odd else torch.float32
    model = _model(width, dtype)
    options: dict[str, Any] = {}
    if strategy == "dp":
        options["example_inputs"] = (torch.randn(8, 16, dtype=dtype),)
        options["bucket_cap_mb"] = 0.001 if kind == "bucket_cap" and odd else None
        options["first_bucket_mb"] = 0.001 if kind == "bucket_cap" and odd else 1.0
    else:
        options["min_unit_numel"] = 1
    if kind == "missing" and odd:
        options["verify"] = False
    try:
        wrapped = lamina.distribute(model, strategy, **options)
    except VerificationError as exc:
        return {"rank": runtime.rank, "outcome": "verification", "message": str(exc)}
    except Exception as exc:  # the rank that skipped verification loses its peer
        return {"rank": runtime.rank, "outcome": type(exc).__name__, "message": str(exc)}
    report = getattr(wrapped, "preflight", None)
    return {"rank": runtime.rank, "outcome": "ok", "message": report.summary() if report else ""}


def _rank() -> int:
    import os

    return int(os.environ["RANK"])


def _run(kind: str, strategy: str = "dp", env: dict[str, str] | None = None) -> list[Any]:
    started = time.monotonic()
    results = run_ranks(
        _mismatch_job, 2, args=(kind, strategy), env={**VERIFY_ENV, **(env or {})}, timeout=60
    )
    assert time.monotonic() - started < 30, "the mismatch was not reported within 30 s"
    return results


def _assert_every_rank_reports(results: list[Any], *fragments: str) -> None:
    messages = {r["message"] for r in results}
    assert len(messages) == 1, f"ranks disagree on the message: {messages}"
    message = messages.pop()
    assert all(r["outcome"] == "verification" for r in results), results
    assert "\n" not in message
    assert "rank(s) [1] differ from rank 0" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.timeout(90)
def test_matching_ranks_pass_quickly() -> None:
    results = _run("none")
    for result in results:
        assert result["outcome"] == "ok", result
        assert "2 ranks agree" in result["message"]
        seconds = float(result["message"].rsplit("(", 1)[1].split(" s")[0])
        assert seconds < 5.0


@pytest.mark.timeout(90)
def test_wider_layer_on_one_rank() -> None:
    results = _run("wider")
    _assert_every_rank_reports(results, "in parameters", "0.weight: [32, 16]", "[48, 16]")


@pytest.mark.timeout(90)
def test_different_bucket_cap() -> None:
    results = _run("bucket_cap")
    _assert_every_rank_reports(results, "in plan", "bucket")


@pytest.mark.timeout(90)
def test_different_dtype() -> None:
    results = _run("dtype")
    _assert_every_rank_reports(results, "in parameters", "float32", "float64")


@pytest.mark.timeout(90)
def test_different_mesh() -> None:
    results = _run("mesh")
    _assert_every_rank_reports(results, "in mesh", "dp", "data")


@pytest.mark.timeout(90)
def test_different_world_shape(tmp_path: Path) -> None:
    """Rank 0 believes in one host with two ranks, rank 1 in two hosts with one each."""
    paths = []
    for hosts in (("node-a", "node-a"), ("node-a", "node-b")):
        spec = {
            "version": 1,
            "devices": [
                {
                    "rank": r,
                    "local_rank": r if hosts[0] == hosts[1] else 0,
                    "host": hosts[r],
                    "device_type": "cpu",
                    "device_index": r if hosts[0] == hosts[1] else 0,
                }
                for r in range(2)
            ],
        }
        path = tmp_path / f"topology{len(set(hosts))}.json"
        path.write_text(json.dumps(spec))
        paths.append(str(path))
    started = time.monotonic()
    results = run_ranks(
        _mismatch_job,
        2,
        args=("world", "dp"),
        env=VERIFY_ENV,
        rank_env=lambda r: {"LAMINA_TOPOLOGY": paths[r]},
        timeout=60,
    )
    assert time.monotonic() - started < 30
    _assert_every_rank_reports(results, "in world", "node-a: ranks [0, 1]")


@pytest.mark.timeout(90)
def test_zero3_wider_layer_names_the_shards() -> None:
    results = _run("wider", "zero3")
    _assert_every_rank_reports(results, "in parameters", "also differ", "shards")


@pytest.mark.timeout(90)
def test_rank_that_never_verifies_is_named() -> None:
    """Rank 1 skips verification and goes straight to its first collective: rank 0 names it
    after the timeout instead of pairing its verification with rank 1's broadcast."""
    started = time.monotonic()
    results = run_ranks(
        _mismatch_job,
        2,
        args=("missing", "dp"),
        env={"LAMINA_VERIFY_TIMEOUT": "4"},
        timeout=60,
    )
    assert time.monotonic() - started < 30
    first = results[0]
    assert first["outcome"] == "verification", first
    assert "rank(s) [1] did not arrive within 4 s" in first["message"]
    assert results[1]["outcome"] != "ok"  # its broadcast lost its peer instead of hanging


def test_world_of_one_skips_verification() -> None:
    lamina.init(backend="cpu")
    wrapped = lamina.distribute(_model(8), "dp", example_inputs=(torch.randn(2, 16),))
    assert wrapped.preflight is not None and wrapped.preflight.world_size == 1
    assert not dist.is_initialized() or dist.get_world_size() == 1
