"""The FP8 block-scaling kernels (``fp8_quantize``, ``fp8_dequantize``) and their references.

A 1-D float buffer is cut into blocks of ``block`` elements. Each block gets one
power-of-two scale ``2 ** e`` (``e`` an ``int8``) that brings its largest magnitude to at
most e4m3's 448; the scaled block is rounded to ``float8_e4m3fn`` and kept as ``uint8``
bits, the form collectives carry. Element ``i`` decodes as
``e4m3(payload[i]) * 2 ** -exponents[i // block]``. A power-of-two scale is exact in
both directions, so quantizing a decoded buffer again gives the same bits.

e4m3fn has no infinity: torch's conversion saturates an infinity to +-448 and keeps
NaN a NaN. A block that is all zeros or holds a non-finite value is scaled as if its
largest magnitude were 1 (exponent 8). Callers that must notice non-finite inputs count
them on the input (:mod:`lamina.comm.fp8` flags them).
"""

from __future__ import annotations

from typing import Any

import torch

from lamina.device.kernel_registry import Dim3, KernelSpec, LaunchConfig
from lamina.errors import KernelError

__all__ = [
    "E4M3_MAX",
    "FP8_KERNELS",
    "MAX_EXPONENT",
    "MIN_EXPONENT",
    "block_exponents",
    "check_fp8_dequantize_args",
    "check_fp8_quantize_args",
    "fp8_dequantize_reference",
    "fp8_quantize_reference",
]

#: Largest finite magnitude of ``float8_e4m3fn``.
E4M3_MAX = 448.0
#: Bounds of a block's scale exponent (it travels as an int8).
MIN_EXPONENT, MAX_EXPONENT = -127, 127
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_block(name: str, numel: int, block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise KernelError(f"{name}: block must be an int >= 1, got {block!r}")
    if numel % block:
        raise KernelError(
            f"{name}: {numel} elements are not whole blocks of {block}; pad the buffer to a "
            f"multiple of {block}"
        )


def check_fp8_quantize_args(
    x: torch.Tensor,
    block: int,
    payload: torch.Tensor | None = None,
    exponents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``fp8_quantize``'s arguments; return the ``(payload, exponents)`` outputs
    (the given ones, or new tensors). Shared by every implementation."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in _FLOATS:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x)
        raise KernelError(f"fp8_quantize: x must be a 1-D fp32/bf16/fp16 tensor, got {got}")
    _check_block("fp8_quantize", x.numel(), block)
    if payload is None:
        payload = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    if exponents is None:
        exponents = torch.empty(x.numel() // block, dtype=torch.int8, device=x.device)
    for label, out, dtype, numel in (
        ("payload", payload, torch.uint8, x.numel()),
        ("exponents", exponents, torch.int8, x.numel() // block),
    ):
        if out.dtype != dtype or out.shape != (numel,) or out.device != x.device:
            raise KernelError(
                f"fp8_quantize: {label} must be a 1-D {dtype} tensor of {numel} elements on "
                f"{x.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
    return payload, exponents


def check_fp8_dequantize_args(
    payload: torch.Tensor, exponents: torch.Tensor, block: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Validate ``fp8_dequantize``'s arguments; return the fp32 output (``out`` or new)."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise KernelError(
            f"fp8_dequantize: payload must be a 1-D uint8 tensor, got {payload.dtype} "
            f"{tuple(payload.shape)}"
        )
    _check_block("fp8_dequantize", payload.numel(), block)
    if exponents.dtype != torch.int8 or exponents.shape != (payload.numel() // block,):
        raise KernelError(
            f"fp8_dequantize: exponents must be {payload.numel() // block} int8 values (one "
            f"per block), got {exponents.dtype} {tuple(exponents.shape)}"
        )
    if out is None:
        return torch.empty(payload.numel(), dtype=torch.float32, device=payload.device)
    if out.dtype != torch.float32 or out.shape != payload.shape or out.device != payload.device:
        raise KernelError(
            f"fp8_dequantize: out must be a 1-D float32 tensor of {payload.numel()} elements "
            f"on {payload.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out


def block_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per block, the largest ``e`` (clamped to the int8 range) with ``amax * 2**e <= 448``
    (fp32; an all-zero or non-finite block takes amax = 1, so ``e = 8``)."""
    finite = torch.isfinite(amax)
    safe = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
    exponent = torch.floor(torch.log2(E4M3_MAX / safe)).clamp(MIN_EXPONENT, MAX_EXPONENT)
    # log2 may round up by one ulp: step back where the block would pass 448
    return exponent - (torch.ldexp(safe, exponent) > E4M3_MAX).float()


def saturated(scaled: torch.Tensor) -> torch.Tensor:
    """``scaled`` clamped to e4m3's finite range (NaN stays NaN): what the cast then
    writes is ±448 for anything beyond, on every torch release (torch before 2.13 casts
    ±inf and values from 480 to NaN, later ones saturate)."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX)


def fp8_quantize_reference(
    config: LaunchConfig,
    x: torch.Tensor,
    block: int,
    payload: torch.Tensor | None = None,
    exponents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in e4m3 bits with one power-of-two scale per block of ``block`` elements."""
    payload, exponents = check_fp8_quantize_args(x, block, payload, exponents)
    with torch.no_grad():
        blocks = x.reshape(-1, block).float()
        exponent = block_exponents(blocks.abs().amax(dim=1, keepdim=True))
        scaled = saturated(torch.ldexp(blocks, exponent)).to(torch.float8_e4m3fn)
        payload.copy_(scaled.view(torch.uint8).reshape(-1))
        exponents.copy_(exponent.reshape(-1).to(torch.int8))
    return payload, exponents


def fp8_dequantize_reference(
    config: LaunchConfig,
    payload: torch.Tensor,
    exponents: torch.Tensor,
    block: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 values of e4m3 ``payload`` with per-block ``exponents``."""
    out = check_fp8_dequantize_args(payload, exponents, block, out)
    with torch.no_grad():
        values = payload.view(torch.float8_e4m3fn).float().reshape(-1, block)
        scale = exponents.float().reshape(-1, 1)
        out.copy_(torch.ldexp(values, -scale).reshape(-1))
    return out


def _per_block_geometry(x: Any, block: Any, *args: Any, **kwargs: Any) -> LaunchConfig:
    """One program per scaling block (``block.x`` = the block size)."""
    numel = x.numel() if isinstance(x, torch.Tensor) else 0
    size = block if isinstance(block, int) and not isinstance(block, bool) and block > 0 else 1
    return LaunchConfig(grid=Dim3(max(1, numel // size)), block=Dim3(size))


def _dequantize_geometry(payload: Any, exponents: Any, block: Any, out: Any = None) -> LaunchConfig:
    return _per_block_geometry(payload, block)


FP8_KERNELS = (
    KernelSpec(
        name="fp8_quantize",
        doc=(
            "fp8_quantize(config, x, block, payload=None, exponents=None) -> (payload, "
            "exponents): 1-D float x as e4m3 bits (uint8) with one int8 power-of-two scale "
            "exponent per block of `block` elements."
        ),
        reference=fp8_quantize_reference,
        geometry=_per_block_geometry,
    ),
    KernelSpec(
        name="fp8_dequantize",
        doc=(
            "fp8_dequantize(config, payload, exponents, block, out=None) -> Tensor: the "
            "float32 values of fp8_quantize's output."
        ),
        reference=fp8_dequantize_reference,
        geometry=_dequantize_geometry,
    ),
)
