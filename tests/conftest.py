"""Shared fixtures: a clean lamina runtime per test and helpers to run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import lamina
from lamina.plugins import BACKEND_ENV, get_registry
from lamina.session import TOPOLOGY_ENV

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_lamina(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts without a runtime or launcher variables, on the cpu backend.

    Core tests pin ``LAMINA_BACKEND=cpu`` so that they mean the same thing in every nox
    session, whatever accelerator backend is installed beside core.
    """
    for name in (
        BACKEND_ENV,
        TOPOLOGY_ENV,
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    lamina.shutdown()
    yield
    lamina.shutdown()
    get_registry(reload=True)


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lamina.cli.main ARGS`` in a fresh interpreter."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "lamina.cli.main", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )
