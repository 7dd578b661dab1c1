"""Every XLA backend test starts without a runtime, process group or launcher variables."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _clean(lamina_clean: None) -> None:
    """Uses the conformance kit's ``lamina_clean`` fixture."""
