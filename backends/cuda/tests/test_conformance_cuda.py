"""The lamina conformance kit against the cuda backend (skips with its reason without a GPU)."""

from __future__ import annotations

import importlib.util

from lamina.testing.conformance import BackendConformance


class TestCudaConformance(BackendConformance):
    backends = ("cuda",)
    # lamina_cuda.plugin registers its Triton kernels wherever triton is installed and a
    # GPU is visible; without a GPU every check skips anyway. Each must run, not the reference.
    expected_kernels = (
        ("pack_bucket", "scale_accumulate", "fp8_quantize", "fp8_dequantize")
        if importlib.util.find_spec("triton")
        else ()
    )
