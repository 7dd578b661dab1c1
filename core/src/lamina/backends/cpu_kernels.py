"""Faster CPU implementations of the built-in kernels, registered under backend ``"cpu"``.

They validate with the same helpers as the references in :mod:`lamina.device.kernels`,
so they reject the same inputs with the same messages, and they are bit-exact against
the references.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lamina.device.kernels import (
    KernelRegistry,
    LaunchConfig,
    check_scale_accumulate_args,
    prepare_pack_bucket,
)

__all__ = ["BACKEND", "pack_bucket_cat", "register_cpu_kernels", "scale_accumulate_add"]

#: The backend name the implementations are registered under.
BACKEND = "cpu"


def pack_bucket_cat(
    config: LaunchConfig, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """``pack_bucket`` as one ``torch.cat`` into the buffer instead of a copy per tensor."""
    buffer, total = prepare_pack_bucket(tensors, out)
    with torch.no_grad():
        torch.cat([t.reshape(-1) for t in tensors], out=buffer.narrow(0, 0, total))
    return buffer


def scale_accumulate_add(
    config: LaunchConfig, dst: torch.Tensor, src: torch.Tensor, scale: float
) -> torch.Tensor:
    """``scale_accumulate`` as one in-place ``dst.add_(src, alpha=scale)`` (no temporary)."""
    check_scale_accumulate_args(dst, src, scale)
    with torch.no_grad():
        dst.add_(src, alpha=scale)
    return dst


def register_cpu_kernels(registry: KernelRegistry) -> None:
    """Register the CPU implementations in ``registry`` under backend ``"cpu"``."""
    registry.register("pack_bucket", BACKEND, pack_bucket_cat)
    registry.register("scale_accumulate", BACKEND, scale_accumulate_add)
