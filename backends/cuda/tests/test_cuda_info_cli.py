"""`lamina info --json` with lamina-backend-cuda installed."""

from __future__ import annotations

import json
import subprocess
import sys

import torch


def test_info_lists_cuda_with_its_reason_and_cpu_available(cuda_reason: str | None) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lamina.cli.main", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["cpu"]["available"] is True
    cuda = backends["cuda"]
    assert (cuda["device_type"], cuda["collective_backend"], cuda["priority"]) == (
        "cuda",
        "nccl",
        100,
    )
    plugin = next(p for p in report["plugins"] if p["name"] == "cuda")
    assert plugin["status"] == "loaded" and plugin["distribution"] == "lamina-backend-cuda"
    if cuda_reason is None:
        assert cuda["available"] is True
        assert report["selected_backend"] == "cuda"
        return
    assert cuda["available"] is False
    assert cuda["reason"] == cuda_reason
    if torch.version.cuda is None:
        assert "CPU-only build" in cuda["reason"]
    assert report["selected_backend"] != "cuda"
