"""The lamina conformance kit, run against the TEMPLATE backend."""

from lamina.testing.conformance import BackendConformance


class TestTemplateConformance(BackendConformance):
    backends = ("template",)
    expected_kernels = ("scale_accumulate",)  # what lamina_template.plugin registers
