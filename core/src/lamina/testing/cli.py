"""Run the ``lamina`` command in a fresh interpreter, as a user would, for tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping


def run_lamina(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m lamina.cli.main ARGS`` with ``env`` added to this environment."""
    return subprocess.run(
        [sys.executable, "-m", "lamina.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        check=False,
    )
