"""Shared fixture: a clean lamina runtime per test, on the cpu backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import lamina
from lamina.plugins import BACKEND_ENV, get_registry
from lamina.session import TOPOLOGY_ENV


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
