"""``lamina trace report``: bandwidth, overlap, stragglers, Chrome trace and timeline on
synthetic traces whose timings are known exactly."""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import pytest

from lamina.cli.trace import add_trace_parser
from lamina.errors import ConfigError
from lamina.testing.cli import run_lamina
from lamina.trace.analysis import (
    build_report,
    op_table,
    overlap_by_step,
    report,
    size_class,
    stragglers,
)
from lamina.trace.events import CollectiveEvent, RankTrace, SpanEvent, read_dir, write_jsonl
from lamina.trace.export import chrome_trace, write_chrome_trace
from lamina.trace.timeline import complete_steps, plot_step

T0 = 1_700_000_000_000_000_000  # a realistic time.time_ns()
MS = 1_000_000
MIB = 1 << 20


def _meta(rank: int, world: int, written: int) -> dict[str, object]:
    return {
        "rank": rank,
        "world_size": world,
        "backend": "cpu",
        "pg_backend": "gloo",
        "clock": "time_ns",
        "reason": "shutdown",
        "capacity": 65536,
        "dropped": 0,
        "written_ns": written,
    }


def _coll(
    rank: int,
    seq: int,
    op: str,
    group: tuple[int, ...],
    nbytes: int,
    node: str,
    step: int,
    issue: int,
    end: int | None,
) -> CollectiveEvent:
    return CollectiveEvent(
        seq, rank, op, group, "float32", nbytes // 4, nbytes, node, step, issue, end
    )


def _dp2(directory: Path) -> Path:
    """2 ranks, 3 steps 1 s apart. Per step (ms from its start): step span 0-400, forward
    10-110, backward 110-300, all_reduce 64 MiB 200-300 (bucket0) and 250-350 (bucket1):
    communication 150 ms, 100 ms of it under backward, 50 ms exposed."""
    directory.mkdir(parents=True, exist_ok=True)
    group = (0, 1)
    for rank in group:
        colls, spans = [], []
        for step in range(3):
            base = T0 + step * 1000 * MS
            spans += [
                SpanEvent(rank, "step", "step", step, base, base + 400 * MS),
                SpanEvent(rank, "compute", "forward", step, base + 10 * MS, base + 110 * MS),
                SpanEvent(rank, "compute", "backward", step, base + 110 * MS, base + 300 * MS),
            ]
            for k, start in enumerate((200, 250)):
                colls.append(
                    _coll(
                        rank,
                        2 * step + k,
                        "all_reduce",
                        group,
                        64 * MIB,
                        f"bucket{k}.all_reduce",
                        step,
                        base + start * MS,
                        base + (start + 100) * MS,
                    )
                )
        write_jsonl(directory / f"rank{rank}.jsonl", _meta(rank, 2, T0 + 3000 * MS), colls, spans)
    return directory


def _four(directory: Path) -> Path:
    """4 ranks; each step a reduce_scatter of 16 MiB then a broadcast of 1 MiB, each taking
    exactly 20 ms / 10 ms from the issuing rank's entry; rank 1 enters every one 30 ms
    late. Rank 0 also issued an all_reduce in step 2 that never completed."""
    directory.mkdir(parents=True, exist_ok=True)
    group = (0, 1, 2, 3)
    for rank in group:
        late = 30 * MS if rank == 1 else 0
        colls = []
        for step in range(2):
            base = T0 + step * 200 * MS + late
            colls += [
                _coll(
                    rank,
                    2 * step,
                    "reduce_scatter",
                    group,
                    16 * MIB,
                    "zero.reduce_scatter",
                    step,
                    base,
                    base + 20 * MS,
                ),
                _coll(
                    rank,
                    2 * step + 1,
                    "broadcast",
                    group,
                    MIB,
                    "init.broadcast",
                    step,
                    base + 50 * MS,
                    base + 60 * MS,
                ),
            ]
        if rank == 0:
            colls.append(
                _coll(0, 4, "all_reduce", group, 4096, "bucket0.all_reduce", 2, T0 + 400 * MS, None)
            )
        write_jsonl(directory / f"rank{rank}.jsonl", _meta(rank, 4, T0 + 900 * MS), colls, [])
    return directory


def test_size_classes() -> None:
    assert size_class(100) == (0, 4096, "<4 KiB")
    assert size_class(4096) == (4096, 8192, "4 KiB-8 KiB")
    assert size_class(64 * MIB) == (64 * MIB, 128 * MIB, "64 MiB-128 MiB")
    assert size_class(64 * MIB + 1)[2] == "64 MiB-128 MiB"
    assert size_class(3 * MIB)[2] == "2 MiB-4 MiB"


def test_bandwidth_matches_the_nccl_tests_formula(tmp_path: Path) -> None:
    rows = {r.op: r for r in op_table(read_dir(_dp2(tmp_path)))}
    ar = rows["all_reduce"]
    assert (ar.count, ar.calls, ar.size_class) == (12, 6, "64 MiB-128 MiB")
    assert ar.median_s == pytest.approx(0.1) and ar.total_s == pytest.approx(1.2)
    assert ar.algbw_gbs == pytest.approx(64 * MIB / 0.1 / 1e9)  # 0.671 GB/s
    assert ar.algbw_gbs == pytest.approx(0.671, abs=1e-3)
    assert ar.busbw_gbs == pytest.approx(64 * MIB / 0.1 / 1e9 * 2 * (2 - 1) / 2)

    four = {r.op: r for r in op_table(read_dir(_four(tmp_path / "four")))}
    assert "all_reduce" not in four  # only completed events count
    rs, bc = four["reduce_scatter"], four["broadcast"]
    assert rs.algbw_gbs == pytest.approx(16 * MIB / 0.02 / 1e9)
    assert rs.busbw_gbs == pytest.approx(16 * MIB / 0.02 / 1e9 * 3 / 4)
    assert bc.algbw_gbs == pytest.approx(MIB / 0.01 / 1e9)
    assert bc.busbw_gbs == pytest.approx(MIB / 0.01 / 1e9)
    assert (rs.count, rs.calls, bc.size_class) == (8, 2, "1 MiB-2 MiB")


def test_overlap_splits_hidden_and_exposed_exactly(tmp_path: Path) -> None:
    rows = overlap_by_step(read_dir(_dp2(tmp_path)))
    assert [(r.rank, r.step) for r in rows] == [(r, s) for r in (0, 1) for s in range(3)]
    for row in rows:
        assert (row.comm_ns, row.hidden_ns, row.exposed_ns) == (150 * MS, 100 * MS, 50 * MS)
        assert row.wall_ns == 400 * MS
        assert row.exposed_pct == pytest.approx(100 / 3)
    # without step spans the wall time is the step's first to last event
    no_steps = {
        r: RankTrace(t.meta, t.collectives, [s for s in t.spans if s.track != "step"])
        for r, t in read_dir(tmp_path).items()
    }
    assert overlap_by_step(no_steps)[0].wall_ns == 340 * MS  # forward 10 .. bucket1 350


def test_straggler_entering_30ms_late_is_named(tmp_path: Path) -> None:
    skew = stragglers(read_dir(_four(tmp_path)))
    assert skew.stragglers == [1]
    assert skew.collectives == 4  # the pending all_reduce is on rank 0 only
    assert skew.median_skew_ns == 30 * MS and skew.max_skew_ns == 30 * MS
    late = {r.rank: r for r in skew.ranks}
    assert late[1].times_last == 4 and late[1].mean_lateness_ns == 30 * MS
    assert late[0].mean_lateness_ns == 0
    assert all(w.last_rank == 1 for w in skew.worst)
    assert stragglers(read_dir(_dp2(tmp_path / "even"))).stragglers == []  # no skew at all


def test_report_totals_and_json(tmp_path: Path) -> None:
    rep = report(_four(tmp_path))
    data = json.loads(json.dumps(rep.to_json()))
    assert data["totals"] == {
        "ranks": 4,
        "rank_ids": [0, 1, 2, 3],
        "world_size": 4,
        "steps": 3,
        "collectives": 5,
        "events": 17,
        "bytes": 2 * (16 * MIB + MIB) + 4096,
        "pending": 1,
        "dropped": 0,
    }
    assert data["stragglers"]["stragglers"] == [1]
    assert {row["op"] for row in data["ops"]} == {"reduce_scatter", "broadcast"}


def test_chrome_trace_has_a_process_per_rank_and_three_threads(tmp_path: Path) -> None:
    path = write_chrome_trace(_dp2(tmp_path))
    assert path == tmp_path / "trace.json"
    events = json.loads(path.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(p, n) for p in (0, 1) for n in ("compute", "communication", "steps")}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 2 * 3 * 5  # ranks x steps x (step, forward, backward, 2 buckets)
    first = min(complete, key=lambda e: e["ts"])
    assert first["ts"] == 0 and first["dur"] == 400_000  # microseconds
    bucket = next(e for e in complete if e["name"] == "bucket1.all_reduce")
    assert bucket["dur"] == 100_000 and bucket["ts"] == 250_000
    assert {"seq", "node", "op", "dtype", "bytes", "group"} <= set(bucket["args"])
    instants = [e["name"] for e in events if e["ph"] == "i" and e["pid"] == 0]
    assert instants == ["step 0", "step 1", "step 2"]


def test_chrome_trace_draws_a_pending_collective_to_the_rank_end(tmp_path: Path) -> None:
    events = chrome_trace(read_dir(_four(tmp_path)))["traceEvents"]
    pending = [e for e in events if e["ph"] == "X" and e["args"].get("pending")]
    assert len(pending) == 1 and pending[0]["pid"] == 0
    assert pending[0]["ts"] == 400_000 and pending[0]["dur"] == 500_000  # to written_ns


def test_timeline_png(tmp_path: Path) -> None:
    traces = read_dir(_dp2(tmp_path))
    assert complete_steps(traces) == [0, 1, 2]
    assert complete_steps(read_dir(_four(tmp_path / "four"))) == [0, 1]
    out = plot_step(traces, None, tmp_path / "t.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 200 + 120 * 2)
    assert 10_000 < len(data) < 500_000
    with pytest.raises(ConfigError, match="step 7 is not in the trace"):
        plot_step(traces, 7, tmp_path / "x.png")


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="lamina")
    add_trace_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def test_report_command_tables_and_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _dp2(tmp_path)
    assert _run("trace", "report", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "all_reduce" in out and "64 MiB-128 MiB" in out and "0.671" in out
    assert "no straggler" in out
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "timeline.png").is_file()
    assert "trace.json" in out and "timeline.png" in out

    json_dir = _four(tmp_path / "four")
    assert _run("trace", "report", str(json_dir), "--json") == 0
    assert json.loads(capsys.readouterr().out)["stragglers"]["stragglers"] == [1]
    assert not (json_dir / "trace.json").exists()  # --json writes nothing by default


def test_report_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "rank0.jsonl").write_text('{"type": "meta", "rank": 0}\n{not json\n')
    with pytest.raises(ConfigError, match=r"rank0\.jsonl line 2"):
        _run("trace", "report", str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        _run("trace", "report", str(tmp_path / "missing"))


@pytest.mark.timeout(60)
def test_cli_report_json_and_malformed_exit_2(tmp_path: Path) -> None:
    result = run_lamina("trace", "report", str(_dp2(tmp_path / "ok")), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["totals"]["ranks"] == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "rank1.jsonl").write_text("garbage\n")
    result = run_lamina("trace", "report", str(bad))
    assert result.returncode == 2 and "rank1.jsonl" in result.stderr


def test_build_report_of_no_collectives() -> None:
    rep = build_report({0: RankTrace(_meta(0, 1, T0))})
    assert rep.ops == [] and rep.stragglers.collectives == 0 and rep.totals["steps"] == 0


def test_timeline_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ConfigError, match=r"lamina-core\[plot\]"):
        plot_step(read_dir(_dp2(tmp_path)), None, tmp_path / "t.png")
