"""End to end: the portable smoke script under the real torchrun launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lamina.testing.cli import run_lamina

pytestmark = [pytest.mark.portable, pytest.mark.cross_release]

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_smoke_script_runs_on_two_ranks_under_torchrun() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "examples" / "smoke_allreduce.py"),
            "--mib",
            "1",
            "--iters",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lamina smoke OK: backend=cpu collectives=gloo world=2" in result.stdout
    assert "2 rank(s) on 1 host(s)" in result.stdout


def test_info_json_names_versions_devices_and_topology() -> None:
    import json

    result = run_lamina("info", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["versions"]["torch"] and report["versions"]["lamina-core"] == "0.1.0"
    assert report["selected_backend"] == "cpu"
    assert report["devices"] == {"type": "cpu", "count": 1}
    assert report["topology"]["host"]
