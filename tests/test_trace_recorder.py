"""The collective trace recorder: ring buffer, files, and traces of real 2-rank runs."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lamina
from lamina.errors import ConfigError
from lamina.testing import run_ranks
from lamina.trace import TraceRecorder, read_dir, read_jsonl
from lamina.trace.analysis import build_report
from lamina.trace.events import busbw_factor

pytestmark = pytest.mark.portable


def test_ring_keeps_the_newest_and_counts_dropped(tmp_path: Path) -> None:
    recorder = TraceRecorder(0, 2, tmp_path, capacity=3)
    for k in range(5):
        with recorder.collective(
            op="all_reduce", group=(0, 1), dtype="float32", numel=4, nbytes=16, node=f"n{k}"
        ):
            pass
    with recorder.collective(
        op="broadcast", group=(0,), dtype="float32", numel=1, nbytes=4, node="other"
    ):
        pass
    events = recorder.events()
    assert [e.node for e in events] == ["n3", "n4", "other"]
    assert [e.seq for e in events] == [3, 4, 0]  # sequence numbers count per group
    assert recorder.dropped == 3 and recorder.pending() == []
    assert all(e.end_ns is not None and e.end_ns >= e.issue_ns for e in events)
    trace = read_jsonl(recorder.write())
    assert trace.meta["dropped"] == 3 and trace.meta["rank"] == 0
    assert [e.node for e in trace.collectives] == ["n3", "n4", "other"]


def test_async_work_completes_through_its_future(tmp_path: Path) -> None:
    recorder = TraceRecorder(0, 1, tmp_path)
    future: torch.futures.Future[None] = torch.futures.Future()

    class Work:
        def get_future(self) -> torch.futures.Future[None]:
            return future

    with recorder.collective(
        op="all_reduce", group=(0,), dtype="float32", numel=1, nbytes=4, node="n"
    ) as handle:
        handle.work = Work()
    assert len(recorder.pending()) == 1
    future.set_result(None)
    assert recorder.pending() == [] and recorder.events()[0].end_ns is not None


def test_disabled_recorder_records_nothing(tmp_path: Path) -> None:
    recorder = TraceRecorder(0, 1, tmp_path)
    recorder.enabled = False
    with recorder.collective(
        op="all_reduce", group=(0,), dtype="float32", numel=1, nbytes=4, node="n"
    ):
        pass
    with recorder.span("compute", "forward"):
        pass
    assert recorder.events() == [] and recorder.spans() == []


def test_bad_trace_files_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "rank0.jsonl"
    bad.write_text('{"type": "collective"}\n')
    with pytest.raises(ConfigError, match=r"rank0\.jsonl line 1"):
        read_jsonl(bad)
    with pytest.raises(ConfigError, match="holds no rank"):
        read_dir(_empty(tmp_path))
    with pytest.raises(ConfigError, match="LAMINA_TRACE_CAPACITY"):
        from lamina.trace.recorder import capacity_from_env

        os.environ["LAMINA_TRACE_CAPACITY"] = "many"
        try:
            capacity_from_env()
        finally:
            del os.environ["LAMINA_TRACE_CAPACITY"]


def _empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_busbw_factors_follow_nccl_tests() -> None:
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("all_gather", 2) == 0.5
    assert busbw_factor("broadcast", 8) == 1.0


def _traced_job(strategy: str, steps: int) -> dict[str, Any]:
    runtime = lamina.init(backend="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 8))
    options: dict[str, Any] = {"example_inputs": (torch.randn(4, 32),)} if strategy == "dp" else {}
    if strategy == "dp":
        options["bucket_cap_mb"] = 0.1
        options["first_bucket_mb"] = 0.05
    else:
        options["min_unit_numel"] = 1
    wrapped = lamina.distribute(model, strategy, **options)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    for _ in range(steps):
        wrapped(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    plan = wrapped.execution_plan
    return {
        "rank": runtime.rank,
        "nodes": {n.id: n.collective.nbytes for n in plan.collectives() if n.collective},
        "ops": {n.id: n.collective.op for n in plan.collectives() if n.collective},
        "setup": [n.id for n in plan.collectives() if n.phase == "setup"],
        "summary": wrapped.step_summary(),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_two_rank_trace_has_one_event_per_planned_collective(strategy: str, tmp_path: Path) -> None:
    steps = 3
    results = run_ranks(
        _traced_job, 2, args=(strategy, steps), env={"LAMINA_TRACE": str(tmp_path)}, timeout=90
    )
    traces = read_dir(tmp_path)
    assert sorted(traces) == [0, 1]
    planned = results[0]["nodes"]
    per_step = [n for n in planned if n not in results[0]["setup"]]
    for rank, trace in traces.items():
        assert trace.meta["world_size"] == 2 and trace.meta["reason"] == "shutdown"
        events = trace.collectives
        assert all(e.end_ns is not None for e in events), "every collective completed"
        counts = Counter(e.node for e in events)
        for node in results[0]["setup"]:
            assert counts[node] == 1
        for node in per_step:
            assert counts[node] == steps, (node, counts)
        assert set(counts) == set(planned)
        for event in events:
            assert event.bytes == planned[event.node], event
            assert event.op == results[0]["ops"][event.node]
            assert event.group == (0, 1) and event.rank == rank
        assert [e.seq for e in events] == list(range(len(events)))
        names = Counter((s.track, s.name) for s in trace.spans)
        assert names[("compute", "forward")] == steps
        assert names[("compute", "backward")] == steps
        assert all(s.end_ns is not None and s.end_ns >= s.start_ns for s in trace.spans)
    first, second = traces[0].collectives, traces[1].collectives
    assert [(e.seq, e.node) for e in first] == [(e.seq, e.node) for e in second]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_one_rank_trace_reports_every_step(strategy: str, tmp_path: Path) -> None:
    """One rank issues no collective: its steps still end, at each synchronizing
    backward, so every step's forward and backward spans carry their own step."""
    steps = 4
    run_ranks(_traced_job, 1, args=(strategy, steps), env={"LAMINA_TRACE": str(tmp_path)})
    trace = read_dir(tmp_path)[0]
    assert trace.collectives == []
    forwards = [s.step for s in trace.spans if (s.track, s.name) == ("compute", "forward")]
    assert len(forwards) == steps and len(set(forwards)) == steps, forwards
    report = build_report({0: trace})
    assert report.totals["steps"] == steps
