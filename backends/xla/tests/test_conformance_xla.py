"""The conformance kit run against the XLA backend (PJRT_DEVICE=CPU runs it here)."""

from lamina.testing.conformance import BackendConformance


class TestXlaConformance(BackendConformance):
    backends = ("xla",)
    flushes_denormals = True  # PJRT's CPU runtime flushes denormals (DAZ/FTZ)
