"""The conformance kit run against the CPU reference backend."""

from lamina.testing.conformance import BackendConformance


class TestCpuConformance(BackendConformance):
    backends = ("cpu",)
