"""``benchmarks/gpu_suite.py --device cpu``: the GPU session's script in its tiny CPU
version, so that it cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# hang guards over 3x the run's time at load average 13-16 on 2 cores (145-207 s)
@pytest.mark.timeout(720)
def test_the_gpu_suite_runs_every_part_on_the_cpu(tmp_path: Path) -> None:
    output = tmp_path / "gpu_cpu.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--device", "cpu",
         "--output", str(output)],
        capture_output=True, text=True, timeout=660, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(output.read_text())
    assert results["backend_tests"]["outcome"].startswith("skipped: the cuda backend suite")
    training = results["training"]
    assert training["outcome"] == "ok"
    assert set(training["variants"]) >= {"dp", "ddp", "zero3", "fsdp2", "zero3_bf16_params"}
    assert {"dp_step", "zero3_step", "ddp_compiled", "fsdp2_compiled"} <= set(training["variants"])
    assert all(v["median_step_s"] > 0 for v in training["variants"].values())
    shared = results["shared_device"]
    assert shared["counts"] == {"passed": 2}
    # asked for by the variable the test configuration honours (it pins LAMINA_BACKEND)
    assert shared["env"] == {"LAMINA_SHARE_DEVICE": "1", "LAMINA_TEST_BACKEND": "cpu"}
    assert results["trace"]["steps_in_report"] == results["trace"]["steps_trained"] == 4
    assert "variant" in proc.stdout and "step ms" in proc.stdout  # the table
