"""What the Triton tests share: the cuda launcher (on a GPU) and a snippet run in a fresh
Python (for the checks that need no GPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from lamina.device.kernels import KernelLauncher
from lamina.plugins import get_registry
from lamina_cuda.plugin import triton_unusable_reason


def triton_launcher(*kernels: str) -> KernelLauncher:
    """The cuda launcher, checked to run the Triton versions of ``kernels``; skips with
    the backend's reason where Triton or a GPU is missing."""
    reason = triton_unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    launcher = KernelLauncher(get_registry().kernels, "cuda")
    for kernel in kernels:
        assert launcher.implementation_name(kernel) == "cuda", kernel
    return launcher


def run_triton_snippet(code: str, done: str, *, interpret: bool = False) -> None:
    """Run ``code`` in a fresh Python (in Triton's CPU interpreter with ``interpret``)
    and check that it printed ``done``; skips where triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed; pip install lamina-backend-cuda[triton]")
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if interpret else {})}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert done in proc.stdout
