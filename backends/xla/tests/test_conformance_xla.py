"""The conformance kit run against the XLA backend (PJRT_DEVICE=CPU runs it here)."""

from lamina.testing.conformance import BackendConformance


class TestXlaConformance(BackendConformance):
    backends = ("xla",)
