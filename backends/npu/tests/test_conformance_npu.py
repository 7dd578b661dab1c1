"""The conformance kit run against the Ascend NPU backend.

Without NPUs every check skips with the backend's own reason (e.g. the missing libhccl.so);
without the package installed, with "backend 'npu' is not installed".
"""

from lamina.testing.conformance import BackendConformance


class TestNpuConformance(BackendConformance):
    backends = ("npu",)
