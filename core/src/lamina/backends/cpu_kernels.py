"""Faster CPU implementations of the built-in kernels, registered under backend ``"cpu"``.

They validate with the same helpers as the references (:mod:`lamina.device.bucket_kernels`,
:mod:`lamina.device.fp8_kernels`), so they reject the same inputs with the same messages,
and they are bit-exact against the references (``scale_accumulate`` too: the same
``add`` with ``alpha``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lamina.device.fp8_kernels import (
    block_exponents,
    check_fp8_dequantize_args,
    check_fp8_quantize_args,
    saturated,
)
from lamina.device.kernels import (
    KernelRegistry,
    LaunchConfig,
    check_scale_accumulate_args,
    prepare_pack_bucket,
)

__all__ = [
    "BACKEND",
    "fp8_dequantize_table",
    "fp8_quantize_exp2",
    "pack_bucket_cat",
    "register_cpu_kernels",
    "scale_accumulate_add",
]

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


#: The float32 value of each of the 256 e4m3fn bit patterns (NaN for 0x7F and 0xFF).
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def fp8_quantize_exp2(
    config: LaunchConfig,
    x: torch.Tensor,
    block: int,
    payload: torch.Tensor | None = None,
    exponents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize`` scaling by a multiply with ``exp2(e)`` (what ``ldexp`` computes,
    without its ``pow``) and rounding straight into the payload's storage."""
    payload, exponents = check_fp8_quantize_args(x, block, payload, exponents)
    with torch.no_grad():
        blocks = x.reshape(-1, block).float()
        exponent = block_exponents(blocks.abs().amax(dim=1, keepdim=True))
        target = payload.view(torch.float8_e4m3fn).view(-1, block)
        target.copy_(saturated(blocks * torch.exp2(exponent)))
        exponents.copy_(exponent.reshape(-1))
    return payload, exponents


def fp8_dequantize_table(
    config: LaunchConfig,
    payload: torch.Tensor,
    exponents: torch.Tensor,
    block: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8_dequantize`` through a 256-entry table of e4m3 values (torch's own fp8 to
    fp32 conversion is several times slower on the CPU), then one scaling multiply."""
    out = check_fp8_dequantize_args(payload, exponents, block, out)
    with torch.no_grad():
        values = _E4M3_VALUES.to(payload.device).index_select(0, payload.int())
        scale = torch.exp2(-exponents.float()).view(-1, 1)
        torch.mul(values.view(-1, block), scale, out=out.view(-1, block))
    return out


def register_cpu_kernels(registry: KernelRegistry) -> None:
    """Register the CPU implementations in ``registry`` under backend ``"cpu"``."""
    registry.register("pack_bucket", BACKEND, pack_bucket_cat)
    registry.register("scale_accumulate", BACKEND, scale_accumulate_add)
    registry.register("fp8_quantize", BACKEND, fp8_quantize_exp2)
    registry.register("fp8_dequantize", BACKEND, fp8_dequantize_table)
