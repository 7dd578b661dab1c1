"""Every core test starts clean, on the cpu backend."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _core_tests_on_cpu(lamina_clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Core tests pin ``LAMINA_BACKEND=cpu`` so that they mean the same thing in every nox
    session, whatever accelerator backend is installed beside core."""
    monkeypatch.setenv("LAMINA_BACKEND", "cpu")
