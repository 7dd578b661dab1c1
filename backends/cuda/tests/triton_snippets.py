"""Running a Triton snippet in a fresh Python, for the tests that need no GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


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
