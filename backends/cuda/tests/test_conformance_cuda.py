"""The lamina conformance kit against the cuda backend (skips with its reason without a GPU)."""

from __future__ import annotations

from lamina.testing.conformance import BackendConformance


class TestCudaConformance(BackendConformance):
    backends = ("cuda",)
