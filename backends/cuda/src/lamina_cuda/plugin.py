"""The ``lamina`` entry point of lamina-backend-cuda: module-level hook implementations."""

from __future__ import annotations

import importlib.util

from lamina.device.backend import Backend
from lamina.device.kernels import KernelRegistry
from lamina.hookspecs import hookimpl
from lamina_cuda.backend import CudaBackend, cuda_unavailable_reason

__all__ = ["lamina_register_backends", "lamina_register_kernels", "triton_unusable_reason"]


def triton_unusable_reason() -> str | None:
    """Why the Triton kernels cannot be used here, or ``None`` when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; pip install lamina-backend-cuda[triton]"
    reason = cuda_unavailable_reason()
    if reason is not None:
        return f"Triton kernels need a CUDA device: {reason}"
    return None


@hookimpl
def lamina_register_backends() -> list[Backend]:
    """The CUDA backend."""
    return [CudaBackend()]


@hookimpl
def lamina_register_kernels(registry: KernelRegistry) -> None:
    """Triton pack_bucket / scale_accumulate / fp8_quantize / fp8_dequantize, when triton is
    installed and a GPU is visible."""
    if triton_unusable_reason() is not None:
        return
    from lamina_cuda.triton_fp8 import register_triton_fp8_kernels
    from lamina_cuda.triton_kernels import register_triton_kernels

    register_triton_kernels(registry)
    register_triton_fp8_kernels(registry)
