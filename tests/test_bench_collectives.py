"""``lamina bench collectives``: the sweep's sizes, its table and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lamina.bench.sweep_options import OPS, parse_size, sweep_sizes
from lamina.cli.main import main as lamina_main
from lamina.errors import ConfigError
from lamina.testing.cli import run_lamina
from lamina.trace.events import busbw_factor

SIZES = [1024 * 2**k for k in range(7)]  # 1K .. 64K


def test_sizes() -> None:
    assert [parse_size(s) for s in ("4096", "1K", "64k", "256M", "2G", "8KiB", "1MB")] == [
        4096,
        1024,
        65536,
        256 << 20,
        2 << 30,
        8192,
        1 << 20,
    ]
    assert sweep_sizes(1024, 65536) == SIZES
    assert sweep_sizes(1000, 5000) == [1000, 2000, 4000]
    for bad in ("", "0", "1T", "-4K", "lots"):
        with pytest.raises(ConfigError, match="is not a positive byte count"):
            parse_size(bad)
    with pytest.raises(ConfigError, match="give no sizes"):
        sweep_sizes(4096, 1024)


def test_bad_options_fail_before_launch(capsys: pytest.CaptureFixture[str]) -> None:
    assert lamina_main(["bench", "collectives", "--max-bytes", "lots"]) == 2
    assert "size 'lots' is not a positive byte count" in capsys.readouterr().err
    assert lamina_main(["bench", "collectives", "--nproc-per-node", "0"]) == 2
    assert "--nproc-per-node must be >= 1" in capsys.readouterr().err
    assert lamina_main(["bench", "collectives", "--iters", "0"]) == 2
    assert lamina_main(["bench", "collectives", "--backend", "no-such-backend"]) == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_sweep_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["collectives", "--nproc-per-node", "2", "--backend", "cpu", "--max-bytes", "64K"]
    args += ["--iters", "2", "--warmup", "1", "--json", str(out)]
    result = run_lamina("bench", *args, timeout=80)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = "lamina bench collectives: 2 rank(s), backend cpu (gloo)"
    assert any(line.startswith(header) for line in lines), result.stdout  # gloo may chatter
    rows = {}
    for line in lines:
        cells = line.split()
        if len(cells) == 6 and cells[2] in OPS:
            rows[(cells[2], int(cells[0]))] = [float(c) for c in cells[3:]]
    assert set(rows) == {(op, size) for op in OPS for size in SIZES}
    for (op, size), (time_us, algbw, busbw) in rows.items():
        # algbw is bytes over time, printed to 1e-4 GB/s and time to 0.1 us: each rounds by
        # half a step (a 1 KB all-reduce slowed to 50 ms by a loaded machine prints 0.0000)
        assert time_us > 0
        expected = size / time_us / 1e3
        assert abs(algbw - expected) <= 6e-5 + expected * 0.06 / time_us, (algbw, expected)
        assert busbw == pytest.approx(algbw * busbw_factor(op, 2), abs=2e-4)
    assert f"results written to {out}" in result.stdout

    report = json.loads(out.read_text())
    assert (report["world_size"], report["dtype"], report["iters"]) == (2, "float32", 2)
    got = {(r["op"], r["bytes"]): r for r in report["results"]}
    assert set(got) == set(rows)
    for (op, size), record in got.items():
        assert record["numel"] * 4 == size and record["ranks"] == 2
        assert record["busbw_factor"] == busbw_factor(op, 2)
        assert record["algbw_gbps"] == pytest.approx(size / (record["time_us"] * 1e3))
        assert record["busbw_gbps"] == pytest.approx(record["algbw_gbps"] * record["busbw_factor"])


@pytest.mark.timeout(150)
def test_algorithm_sweep_on_an_interleaved_two_host_layout(tmp_path: Path) -> None:
    from topologies_for_tests import two_hosts_interleaved

    topology = tmp_path / "interleaved.json"
    topology.write_text(json.dumps(two_hosts_interleaved()))
    out = tmp_path / "algorithms.json"
    args = ["collectives", "--nproc-per-node", "4", "--backend", "cpu", "--algorithm", "all"]
    args += ["--min-bytes", "256K", "--max-bytes", "256K", "--iters", "1", "--warmup", "0"]
    args += ["--json", str(out)]
    result = run_lamina("bench", *args, env={"LAMINA_TOPOLOGY": str(topology)}, timeout=140)
    assert result.returncode == 0, result.stderr
    assert "cost model: 4 rank(s) on 2 host(s) x 2" in result.stdout
    report = json.loads(out.read_text())
    assert report["model"]["hosts"] == [[0, 2], [1, 3]]
    assert report["model"]["source"] == "calibrated"
    rows = {r["algorithm"]: r for r in report["algorithms"]}
    expected = {"flat", "ordered", "hierarchical", "pipelined", "auto", "inter-phase"}
    assert set(rows) == expected
    for row in rows.values():
        assert row["bytes"] == 256 << 10 and row["time_us"] > 0 and row["predicted_us"] > 0
    assert rows["auto"]["chosen"] in {"flat", "ordered", "hierarchical", "pipelined"}
