"""The lamina conformance kit, run against backend "template"."""

from lamina.testing.conformance import BackendConformance


class TestTemplateConformance(BackendConformance):
    backends = ("template",)
    expected_kernels = ("scale_accumulate",)  # what lamina_template.plugin registers
