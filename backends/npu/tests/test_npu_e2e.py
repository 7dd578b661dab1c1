"""End to end in an environment with torch_npu but no CANN toolkit (the nox npu session).

Proves what the start-up guard is for: without it ``import torch`` fails there; with it
``import torch`` and ``lamina info`` work and report npu unavailable because of libhccl.so.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("torch_npu") is None:
    pytest.skip("torch_npu is not installed", allow_module_level=True)
try:
    md.distribution("lamina-backend-npu")
except md.PackageNotFoundError:
    pytest.skip("lamina-backend-npu is not installed", allow_module_level=True)

from lamina_npu.cann import probe_cann

if probe_cann().usable:
    pytest.skip(
        "the CANN toolkit is on this machine's library path: the unavailable path cannot occur",
        allow_module_level=True,
    )

_CLEARED = ("TORCH_DEVICE_BACKEND_AUTOLOAD", "LAMINA_NPU_AUTOLOAD_DISABLED", "LAMINA_BACKEND")


def _python(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter whose environment has no guard decisions inherited from this one."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(extra)
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=240, check=False
    )


def test_without_the_guard_import_torch_fails() -> None:
    proc = _python("-c", "import torch", TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    assert proc.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in proc.stderr
    assert "libhccl.so: cannot open shared object file" in proc.stderr


def test_import_torch_works_and_the_guard_says_why() -> None:
    code = (
        "import os, torch; "
        "print(os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD']); "
        "print(os.environ['LAMINA_NPU_AUTOLOAD_DISABLED'])"
    )
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr
    autoload, reason = proc.stdout.splitlines()[:2]
    assert autoload == "0"
    assert "libhccl.so" in reason


def test_lamina_info_reports_npu_unavailable_and_cpu_available() -> None:
    proc = _python("-m", "lamina.cli.main", "info", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["npu"]["available"] is False
    assert "libhccl" in backends["npu"]["reason"]
    assert backends["npu"]["collective_backend"] == "hccl"
    assert backends["cpu"]["available"] is True
    assert report["selected_backend"] == "cpu"


def test_lamina_info_table_names_libhccl() -> None:
    proc = _python("-m", "lamina.cli.main", "info")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    npu = next(line.strip() for line in lines if line.strip().startswith("npu: "))
    assert npu.startswith("npu: unavailable — ") and "libhccl.so" in npu and "CANN" in npu
    assert any(line.strip().startswith("cpu: available") for line in lines)
