# mypy: allow-untyped-defs, allow-incomplete-defs
"""Triton implementations of ``fp8_quantize`` / ``fp8_dequantize``, backend ``"cuda"``.

Imported only after :func:`lamina_cuda.plugin.triton_unusable_reason` found triton and a
CUDA device, like :mod:`lamina_cuda.triton_kernels`. One program handles one scaling
block (``BLOCK`` = the block size, a power of two); ``grid.x`` programs walk the blocks
in a grid-stride loop, so any grid covers the whole buffer. Blocks that are not a power
of two (or larger than :data:`MAX_BLOCK`), CPU tensors and non-contiguous outputs run
the core references.

Results are bit-exact to the references. The e4m3fn conversion is integer arithmetic
that mirrors torch's own (``c10`` ``fp8e4m3fn_from_fp32_value``: round to nearest even,
finite overflow and infinity saturate to 448, NaN stays NaN with its sign) instead of
``x.to(tl.float8e4nv)``: that cast does not compile before sm_89, and Triton's CPU
interpreter rounds it differently (ties away, no carry, no saturation).
"""

from collections.abc import Callable
from typing import Any, cast

import torch
import triton
import triton.language as tl

from lamina.device.fp8_kernels import (
    check_fp8_dequantize_args,
    check_fp8_quantize_args,
    fp8_dequantize_reference,
    fp8_quantize_reference,
)
from lamina.device.kernels import KernelRegistry, LaunchConfig
from lamina.errors import KernelError

__all__ = [
    "BACKEND",
    "MAX_BLOCK",
    "fp8_dequantize_triton",
    "fp8_quantize_triton",
    "launch_fp8_dequantize",
    "launch_fp8_quantize",
    "register_triton_fp8_kernels",
]

#: The backend name the implementations are registered under.
BACKEND = "cuda"
#: The largest scaling block run by Triton (one program holds a whole block).
MAX_BLOCK = 1 << 14

_jit = cast("Callable[[Callable[..., None]], Any]", triton.jit)


@_jit
def _exp2i(k):
    """``2.0 ** k`` in fp32, exact, for int32 ``k`` in [-127, 128] (128 gives inf)."""
    bits = tl.where(k > -127, (k + 127) << 23, 1 << 22)  # 2**-127 is a subnormal
    return bits.to(tl.float32, bitcast=True)


@_jit
def _load_fp32(ptrs):
    """Load as fp32 (exact); bf16 is widened by a 16-bit shift, which Triton's CPU
    interpreter gets right for subnormals where its ``.to(tl.float32)`` does not."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = tl.load(ptrs).to(tl.int16, bitcast=True).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    return tl.load(ptrs).to(tl.float32)


@_jit
def _block_exponent(amax_bits):
    """The block's scale exponent from the bits of its largest magnitude (int32 >= 0).

    The largest ``e`` in [-127, 127] with ``amax * 2**e <= 448 = 1.75 * 2**8``. Like the
    reference, an all-zero or non-finite block is scaled as if its amax were 1.0.
    """
    special = (amax_bits == 0) | (amax_bits >= 0x7F800000)
    amax_bits = tl.where(special, 0x3F800000, amax_bits)
    over = ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa above 1.75
    e = 135 - (amax_bits >> 23) - over  # 8 - (biased exponent - 127) - over
    return tl.minimum(tl.maximum(e, -127), 127)


@_jit
def _e4m3_bits(s):
    """fp32 ``s`` rounded to e4m3fn bits (int32 in [0, 255]), exactly as torch rounds."""
    bits = s.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # |s| < 2**-6: adding 2**14 rounds |s| to a multiple of 2**-9 (nearest even)
    tiny = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    # normal: rebias the exponent and round the 20 dropped mantissa bits to nearest even
    odd = (mag >> 20) & 1
    normal = tl.minimum((mag - (120 << 23) + 0x7FFFF + odd) >> 20, 0x7E)
    big = tl.where(mag > 0x7F800000, 0x7F, 0x7E)  # NaN stays NaN; >= 480 and inf saturate
    code = tl.where(mag < (121 << 23), tiny, tl.where(mag >= (1087 << 20), big, normal))
    return code | sign


@_jit
def _e4m3_value(code):
    """The fp32 value of e4m3fn bits ``code`` (int32 in [0, 255]), bit for bit as torch's."""
    sign = (code & 0x80) << 24
    nonsign = code & 0x7F
    mant = nonsign & 7
    normal = ((nonsign >> 3) + 120) << 23 | (mant << 20)
    tiny = (mant.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # mant * 2**-9
    bits = tl.where(nonsign == 0x7F, 0x7FF00000, tl.where(nonsign < 8, tiny, normal))
    return (bits | sign).to(tl.float32, bitcast=True)


@_jit
def _fp8_quantize_kernel(x_ptr, payload_ptr, exponents_ptr, nblocks, BLOCK: tl.constexpr):
    """Grid-stride over the scaling blocks: one exponent and ``BLOCK`` e4m3 codes each."""
    blk = tl.program_id(0).to(tl.int64)  # int64 offsets: buffers may pass 2**31 elements
    nprog = tl.num_programs(0).to(tl.int64)
    while blk < nblocks:  # a while loop: Triton 3.6's interpreter cannot range() here
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        x = _load_fp32(x_ptr + offs)
        # magnitudes compare as their bits: an integer max sees NaN and inf too
        e = _block_exponent(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))
        codes = _e4m3_bits(x * _exp2i(e))
        tl.store(payload_ptr + offs, codes.to(tl.uint8))
        tl.store(exponents_ptr + blk, e.to(tl.int8))
        blk += nprog


@_jit
def _fp8_dequantize_kernel(payload_ptr, exponents_ptr, out_ptr, nblocks, BLOCK: tl.constexpr):
    """Grid-stride over the scaling blocks: ``e4m3(code) * 2**-e`` in fp32."""
    blk = tl.program_id(0).to(tl.int64)  # int64 offsets: buffers may pass 2**31 elements
    nprog = tl.num_programs(0).to(tl.int64)
    while blk < nblocks:  # a while loop: Triton 3.6's interpreter cannot range() here
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        codes = tl.load(payload_ptr + offs).to(tl.int32)
        e = tl.load(exponents_ptr + blk).to(tl.int32)
        tl.store(out_ptr + offs, _e4m3_value(codes) * _exp2i(-e))
        blk += nprog


def _grid(config: LaunchConfig, kernel: str) -> int:
    """``grid.x`` of a 1-D launch config (the programs that walk the blocks)."""
    block, grid = config.block, config.grid
    if block.y != 1 or block.z != 1 or grid.y != 1 or grid.z != 1:
        raise KernelError(
            f"{kernel} (triton): launch geometry must be 1-D, got grid {grid} block {block}; "
            "pass Dim3(x) for both"
        )
    return grid.x


def _runs_in_triton(
    block: int, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]
) -> bool:
    """Whether Triton covers this call: a power-of-two block, every tensor on one CUDA
    device, and contiguous outputs (inputs are made contiguous)."""
    if block & (block - 1) or block > MAX_BLOCK:
        return False
    device = outputs[0].device
    if device.type != "cuda" or any(t.device != device for t in (*inputs, *outputs)):
        return False
    return all(o.is_contiguous() for o in outputs)


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


def fp8_quantize_triton(
    config: LaunchConfig,
    x: torch.Tensor,
    block: int,
    payload: torch.Tensor | None = None,
    exponents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize`` as one Triton launch, one program per scaling block."""
    payload, exponents = check_fp8_quantize_args(x, block, payload, exponents)
    grid = _grid(config, "fp8_quantize")
    if x.numel() == 0:
        return payload, exponents
    if not _runs_in_triton(block, (x,), (payload, exponents)):
        return fp8_quantize_reference(config, x, block, payload, exponents)
    launch_fp8_quantize(x.detach().contiguous(), payload, exponents, block, grid)
    return payload, exponents


def launch_fp8_quantize(
    x: torch.Tensor, payload: torch.Tensor, exponents: torch.Tensor, block: int, grid: int
) -> None:
    """Run the quantize kernel on contiguous, validated tensors (``block`` a power of two)."""
    kernel = _fp8_quantize_kernel[(grid,)]
    kernel(x, payload, exponents, x.numel() // block, BLOCK=block, num_warps=_num_warps(block))


def fp8_dequantize_triton(
    config: LaunchConfig,
    payload: torch.Tensor,
    exponents: torch.Tensor,
    block: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8_dequantize`` as one Triton launch, one program per scaling block."""
    out = check_fp8_dequantize_args(payload, exponents, block, out)
    grid = _grid(config, "fp8_dequantize")
    if payload.numel() == 0:
        return out
    if not _runs_in_triton(block, (payload, exponents), (out,)):
        return fp8_dequantize_reference(config, payload, exponents, block, out)
    launch_fp8_dequantize(payload.contiguous(), exponents.contiguous(), out, block, grid)
    return out


def launch_fp8_dequantize(
    payload: torch.Tensor, exponents: torch.Tensor, out: torch.Tensor, block: int, grid: int
) -> None:
    """Run the dequantize kernel on contiguous, validated tensors (``block`` a power of two)."""
    kernel = _fp8_dequantize_kernel[(grid,)]
    kernel(
        payload, exponents, out, payload.numel() // block, BLOCK=block, num_warps=_num_warps(block)
    )


def register_triton_fp8_kernels(registry: KernelRegistry) -> None:
    """Register the Triton fp8 kernels in ``registry`` under backend ``"cuda"``."""
    registry.register("fp8_quantize", BACKEND, fp8_quantize_triton)
    registry.register("fp8_dequantize", BACKEND, fp8_dequantize_triton)
