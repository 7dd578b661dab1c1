"""The examples on the test harness's ranks: each rank runs ``examples/<script>``'s
``main(argv)`` in a process forked with torch (and transformers, peft) already imported,
under torchrun's environment variables. A torchrun launch imports them in its agent and
in every rank (~2.5 s of CPU each, ~5 s with transformers); the tests of ``lamina run``
and torchrun themselves launch for real."""

from __future__ import annotations

import contextlib
import importlib
import io
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from lamina.testing import run_ranks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example_rank(script: str, argv: list[str]) -> dict[str, Any]:
    """One rank of ``examples/<script>``, run by its ``main(argv)``: its exit status and
    what it printed (warnings shown as a plain ``python`` process shows them)."""
    sys.path.insert(0, str(EXAMPLES))
    example = importlib.import_module(Path(script).stem)
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("default")
        code = example.main(argv)
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def run_example(
    script: str,
    *args: str,
    ranks: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 100,
) -> subprocess.CompletedProcess[str]:
    """``examples/<script>`` on ``ranks`` harness ranks, read as a launch of it would be:
    rank 0's exit status and output, every rank's errors."""
    results = run_ranks(_example_rank, ranks, args=(script, list(args)), env=env, timeout=timeout)
    stderr = "".join(r["stderr"] for r in results)
    return subprocess.CompletedProcess(
        [script, *args], results[0]["returncode"], results[0]["stdout"], stderr
    )
