"""The conformance kit run against the CPU reference backend."""

from lamina.testing.conformance import BackendConformance


class TestCpuConformance(BackendConformance):
    backends = ("cpu",)
    expected_kernels = ("pack_bucket", "scale_accumulate")
