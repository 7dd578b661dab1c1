"""Kernels of backend "template": one implementation of a built-in kernel.

A real backend launches its own device code here (a Triton kernel, a vendor op) with
the :class:`~lamina.device.kernels.LaunchConfig` it is given; the template runs the
same arithmetic as the pure-torch reference on the host. Whatever the body, it must
validate with the kernel's shared helper (same errors as the reference) and agree with
the reference, which the conformance kit checks.
"""

from __future__ import annotations

import torch

from lamina.device.kernels import KernelRegistry, LaunchConfig, check_scale_accumulate_args
from lamina.errors import KernelError

__all__ = ["register_template_kernels", "scale_accumulate_template"]


def scale_accumulate_template(
    config: LaunchConfig, dst: torch.Tensor, src: torch.Tensor, scale: float
) -> torch.Tensor:
    """``dst += scale * src`` in place, one (notional) thread per element; returns ``dst``.

    Vendor: ``kernel[(config.grid.x,)](dst, src, scale, dst.numel(), BLOCK=config.block.x)``.
    Here: one in-place ``add_``, bit-identical to the reference's ``torch.add``.
    """
    check_scale_accumulate_args(dst, src, scale)
    threads = config.grid.volume * config.block.volume
    if threads < dst.numel():
        # On a device a launch this small would leave elements untouched; refuse it.
        raise KernelError(
            f"scale_accumulate (template): launch of {threads} threads cannot cover "
            f"{dst.numel()} elements; omit grid= to use the default geometry"
        )
    with torch.no_grad():
        dst.add_(src, alpha=scale)
    return dst


def register_template_kernels(registry: KernelRegistry, backend: str) -> None:
    """Register this package's implementations in ``registry`` under ``backend``."""
    registry.register("scale_accumulate", backend, scale_accumulate_template)
