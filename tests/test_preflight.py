"""Pre-flight verification inside ``lamina.distribute``: mismatches fail on every rank.

Each case injects one difference on rank 1 and checks that every rank that reached the
verifier raises the same one-line diff (naming rank 1, the category and both values)
instead of hanging in the first collective. Every rank seeds its model with its own rank:
the verifier compares structure (shapes, dtypes, graph, plan), never values, so the
difference reported is the injected one.

The cases run one after another in one 2-rank job: each builds its runtime on the job's
process group (``lamina.init`` joins it, ``lamina.shutdown`` leaves it) and its pre-flight
check has its own store keys, and a failed check leaves no collective half done, so the
cases do not see each other. A rank that skips verification breaks its process group, so
that case has its own job.
"""

from __future__ import annotations

import json
import os
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

pytestmark = [pytest.mark.portable, pytest.mark.multiprocess]

#: Arrival timeout of the shared job. Ranks that differ are reported from the digests once
#: both arrived, so no case may take this long: each is checked to end well before it
#: (a case measured 0.05-0.2 s here, 34 s on a GPU host running 8 test workers).
VERIFY_TIMEOUT_S = 120.0
#: (kind, strategy) of each case of the shared job; the difference is on rank 1 only.
CASES = (
    ("none", "dp"),
    ("wider", "dp"),
    ("bucket_cap", "dp"),
    ("dtype", "dp"),
    ("mesh", "dp"),
    ("world", "dp"),
    ("wider", "zero3"),
    ("order", "zero3"),  # last: its check fails inside the first forward
)
Results = dict[str, list[dict[str, Any]]]


def _model(width: int, dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4)).to(dtype)


class _Blocks(nn.Module):
    """Two blocks of one size, called first to last, or last to first (``backwards``): the
    gathers still pair up across the ranks (two of one size each), so the forward ends and
    the check of its recorded order names the difference. (Where they do not pair up, the
    gathers themselves diverge first: the trace watchdog's case.)"""

    def __init__(self, backwards: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.backwards = backwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks) if self.backwards else self.blocks:
            x = block(x)
        return x


def _case(kind: str, strategy: str, rank: int, topology: str | None = None) -> dict[str, Any]:
    """One rank of a case where rank 1 differs as ``kind`` says; returns what happened."""
    odd = rank == 1
    mesh: Any = ((2,), ("data",)) if kind == "mesh" and odd else "flat"
    result: dict[str, Any] = {"rank": rank}
    started = time.monotonic()
    try:  # a rank that builds another mesh is named by lamina.init, before any mesh group
        lamina.init(backend="cpu", mesh=mesh, topology=topology if kind == "world" else None)
    except VerificationError as exc:
        result.update(outcome="verification", message=str(exc))
        result["seconds"] = time.monotonic() - started
        return result
    width = 48 if kind == "wider" and odd else 32
    dtype = torch.float64 if kind == "dtype" and odd else torch.float32
    model = _Blocks(backwards=odd) if kind == "order" else _model(width, dtype, seed=rank)
    options: dict[str, Any] = {}
    if strategy == "dp":
        options["example_inputs"] = (torch.randn(8, 16, dtype=dtype),)
        options["bucket_cap_mb"] = 0.001 if kind == "bucket_cap" and odd else None
        options["first_bucket_mb"] = 0.001 if kind == "bucket_cap" and odd else 1.0
    else:
        options["min_unit_numel"] = 1
    if kind == "missing":  # a job of its own, about arrival: fx capture imports no dynamo
        options["capture_methods"] = ("fx",)
        options["verify"] = not odd
    try:
        wrapped = lamina.distribute(model, strategy, **options)
        if kind == "order":  # the units' order is recorded, and checked, at this forward
            wrapped(torch.randn(2, 8)).sum().backward()
    except VerificationError as exc:
        result.update(outcome="verification", message=str(exc))
    except Exception as exc:  # the rank that skipped verification loses its peer
        result.update(outcome=type(exc).__name__, message=str(exc))
    else:
        report = getattr(wrapped, "preflight", None)
        result.update(outcome="ok", message=report.summary() if report else "")
    result["seconds"] = time.monotonic() - started
    lamina.shutdown()
    return result


def _all_cases(topologies: list[str]) -> dict[str, dict[str, Any]]:
    """Every case of :data:`CASES` on this rank, over one process group."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    return {f"{k}/{s}": _case(k, s, rank, topologies[rank]) for k, s in CASES}


def _topology_files(folder: Path) -> list[str]:
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
        path = folder / f"topology{len(set(hosts))}.json"
        path.write_text(json.dumps(spec))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Results:
    paths = _topology_files(tmp_path_factory.mktemp("topology"))
    env = {"LAMINA_VERIFY_TIMEOUT": str(VERIFY_TIMEOUT_S)}
    by_rank = run_ranks(_all_cases, 2, args=(paths,), env=env, timeout=300)
    return {case: [ranks[case] for ranks in by_rank] for case in by_rank[0]}


def _assert_every_rank_reports(results: list[dict[str, Any]], *fragments: str) -> None:
    messages = {r["message"] for r in results}
    assert len(messages) == 1, f"ranks disagree on the message: {messages}"
    message = messages.pop()
    assert all(r["outcome"] == "verification" for r in results), results
    assert "\n" not in message
    assert "rank(s) [1] differ from rank 0" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    # reported from the digests, not by waiting out the arrival timeout (measured 0.05-0.2 s
    # at load average 4.5 on 2 cores, capture included)
    assert all(r["seconds"] < VERIFY_TIMEOUT_S for r in results), results


@pytest.mark.timeout(360)
def test_matching_ranks_pass_quickly(cases: Results) -> None:
    """Different initial values (rank seeds) but the same model: they agree."""
    for result in cases["none/dp"]:
        assert result["outcome"] == "ok", result
        assert "2 ranks agree" in result["message"]
        seconds = float(result["message"].rsplit("(", 1)[1].split(" s")[0])
        # the check itself never waited for the timeout (measured 0.2 s at load average 4.5)
        assert seconds < VERIFY_TIMEOUT_S


@pytest.mark.timeout(360)
def test_wider_layer_on_one_rank(cases: Results) -> None:
    _assert_every_rank_reports(cases["wider/dp"], "in parameters", "0.weight: [32, 16]", "[48, 16]")


@pytest.mark.timeout(360)
def test_different_bucket_cap(cases: Results) -> None:
    _assert_every_rank_reports(cases["bucket_cap/dp"], "in plan", "bucket")


@pytest.mark.timeout(360)
def test_different_dtype(cases: Results) -> None:
    _assert_every_rank_reports(cases["dtype/dp"], "in parameters", "float32", "float64")


@pytest.mark.timeout(360)
def test_different_mesh(cases: Results) -> None:
    _assert_every_rank_reports(cases["mesh/dp"], "in mesh", "dp", "data")


@pytest.mark.timeout(360)
def test_different_world_shape(cases: Results) -> None:
    """Rank 0 believes in one host with two ranks, rank 1 in two hosts with one each."""
    _assert_every_rank_reports(cases["world/dp"], "in world", "node-a: ranks [0, 1]")


@pytest.mark.timeout(360)
def test_zero3_wider_layer_names_the_shards(cases: Results) -> None:
    _assert_every_rank_reports(cases["wider/zero3"], "in parameters", "also differ", "shards")


def _never_verifies_job() -> dict[str, Any]:
    return _case("missing", "dp", int(os.environ["RANK"]))


@pytest.mark.timeout(90)
@pytest.mark.timeout(360)
def test_zero3_units_entered_in_another_order_are_named_at_the_first_forward(
    cases: Results,
) -> None:
    """The plan the first forward fills in (its unit order) is verified like the rest:
    rank 1's forward calls the blocks last to first (sizes alike: the gathers pair up)."""
    _assert_every_rank_reports(cases["order/zero3"], "plan")


def test_rank_that_never_verifies_is_named() -> None:
    """Rank 1 skips verification and goes straight to its first collective: rank 0 names it
    after the timeout instead of pairing its verification with rank 1's broadcast."""
    timeout = 1.0  # rank 1 never arrives: any timeout shows it, the shortest costs least
    results = run_ranks(
        _never_verifies_job, 2, env={"LAMINA_VERIFY_TIMEOUT": f"{timeout:g}"}, timeout=60
    )
    first = results[0]
    assert first["outcome"] == "verification", first
    assert "rank(s) [1] did not arrive within 1 s" in first["message"]
    assert first["seconds"] >= timeout  # named after the timeout, not before
    assert results[1]["outcome"] != "ok"  # its broadcast lost its peer instead of hanging


def test_world_of_one_skips_verification() -> None:
    lamina.init(backend="cpu")
    wrapped: Any = lamina.distribute(
        _model(8, torch.float32, seed=0), "dp", example_inputs=(torch.randn(2, 16),)
    )
    assert wrapped.preflight is not None and wrapped.preflight.world_size == 1
    assert not dist.is_initialized() or dist.get_world_size() == 1
