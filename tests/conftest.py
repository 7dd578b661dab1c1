"""Every core test starts clean, on the cpu backend; a test meant to run on the device asks
for ``device_backend`` (``$LAMINA_TEST_BACKEND``, cpu when unset: ``requested_backend.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from requested_backend import usable_requested_backend


@pytest.fixture(scope="session", autouse=True)
def _core_jobs_on_cpu() -> Iterator[None]:
    """``LAMINA_BACKEND=cpu`` for the whole session, so that module-scoped jobs (set up
    before any function-scoped fixture) also start their ranks on cpu, whatever
    accelerator backend is installed beside core."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAMINA_BACKEND", "cpu")
        yield


@pytest.fixture(autouse=True)
def _core_tests_on_cpu(lamina_clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Core tests pin ``LAMINA_BACKEND=cpu`` so that they mean the same thing in every nox
    session, whatever accelerator backend is installed beside core (``lamina_clean``
    removes launcher variables first)."""
    monkeypatch.setenv("LAMINA_BACKEND", "cpu")


@pytest.fixture(scope="session")
def device_backend() -> str:
    """The backend ``$LAMINA_TEST_BACKEND`` asks the device tests to run on (cpu when unset;
    one named but missing or unable to run here fails the test). Such a test starts its
    ranks on it by name, since ``LAMINA_BACKEND`` stays cpu, and checks that it ran there."""
    return usable_requested_backend()
