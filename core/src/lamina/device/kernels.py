"""Named kernels with a launch geometry, a pure-torch reference, and per-backend implementations.

The public face of the kernel modules, where plugins and users import from:

- :mod:`lamina.device.kernel_registry`: :class:`Dim3`, :class:`LaunchConfig`,
  :class:`KernelSpec`, :class:`KernelRegistry`, :class:`KernelLauncher` (how a kernel is
  defined, registered per backend and launched, falling back to its reference);
- :mod:`lamina.device.bucket_kernels`: ``pack_bucket``, ``unpack_bucket``,
  ``scale_accumulate`` and their shared argument checks;
- :mod:`lamina.device.fp8_kernels`: ``fp8_quantize``, ``fp8_dequantize``.

Both kernel modules build on the registry module only; this module gathers them into
:func:`builtin_registry`, and nothing in the device layer imports it back.
"""

from __future__ import annotations

from lamina.device.bucket_kernels import (
    BUCKET_KERNELS,
    check_scale_accumulate_args,
    prepare_pack_bucket,
)
from lamina.device.fp8_kernels import FP8_KERNELS
from lamina.device.kernel_registry import (
    REFERENCE,
    Dim3,
    KernelFn,
    KernelLauncher,
    KernelRegistry,
    KernelSpec,
    LaunchConfig,
    elementwise_geometry,
)

__all__ = [
    "REFERENCE",
    "Dim3",
    "KernelFn",
    "KernelLauncher",
    "KernelRegistry",
    "KernelSpec",
    "LaunchConfig",
    "builtin_registry",
    "check_scale_accumulate_args",
    "elementwise_geometry",
    "prepare_pack_bucket",
]


def builtin_registry() -> KernelRegistry:
    """A new registry with the built-in kernels defined (and no backend implementations)."""
    registry = KernelRegistry()
    for spec in (*BUCKET_KERNELS, *FP8_KERNELS):
        registry.define(spec)
    return registry
