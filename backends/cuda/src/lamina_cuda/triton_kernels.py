# mypy: allow-untyped-defs, allow-incomplete-defs
"""Triton implementations of the built-in kernels, registered under backend ``"cuda"``.

This module imports ``triton`` at the top: :mod:`lamina_cuda.plugin` imports it only
after :func:`lamina_cuda.plugin.triton_unusable_reason` found triton and a CUDA
device. Both kernels honour the launch config: ``block.x`` is the Triton ``BLOCK_SIZE``
(a power of two) and ``grid.x`` programs walk the blocks in a grid-stride loop (a
``while`` loop: Triton 3.6's interpreter cannot ``range()`` over a program id), so any
grid covers the whole buffer. Arguments are validated with the same core helpers as the
references; inputs the kernels do not cover (CPU tensors, complex or fp8 dtypes, fp64 for
``scale_accumulate``, non-contiguous ``dst``) run the equivalent torch operation.
"""

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import triton
import triton.language as tl

from lamina.device.kernels import (
    KernelRegistry,
    LaunchConfig,
    check_scale_accumulate_args,
    prepare_pack_bucket,
)
from lamina.errors import KernelError

__all__ = ["BACKEND", "pack_bucket_triton", "register_triton_kernels", "scale_accumulate_triton"]

#: The backend name the implementations are registered under.
BACKEND = "cuda"

_jit = cast("Callable[[Callable[..., None]], Any]", triton.jit)

#: dtypes the pack kernel copies (a plain load/store, so every real type Triton stores).
_PACK_DTYPES = frozenset(
    {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
    }
)
#: dtypes scale_accumulate computes in fp32 (the scale is passed as an fp32 scalar).
_ACCUMULATE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


@_jit
def _pack_kernel(out_ptr, src_ptrs, starts, num_tensors, total, BLOCK_SIZE: tl.constexpr):
    """Grid-stride over ``out``; each block copies the slices of the tensors it overlaps."""
    blk = tl.program_id(0).to(tl.int64)  # int64 offsets: buffers may pass 2**31 elements
    nprog = tl.num_programs(0).to(tl.int64)
    nblocks = tl.cdiv(total, BLOCK_SIZE)
    while blk < nblocks:  # a while loop: Triton 3.6's interpreter cannot range() here
        lo = blk * BLOCK_SIZE
        offs = lo + tl.arange(0, BLOCK_SIZE)
        t = 0
        while t < num_tensors:
            start = tl.load(starts + t)
            end = tl.load(starts + t + 1)
            if (start < lo + BLOCK_SIZE) & (end > lo):
                src = tl.load(src_ptrs + t).to(tl.pointer_type(out_ptr.dtype.element_ty))
                mask = (offs >= start) & (offs < end)
                vals = tl.load(src + (offs - start), mask=mask)
                tl.store(out_ptr + offs, vals, mask=mask)
            t += 1
        blk += nprog


@_jit
def _scale_accumulate_kernel(dst_ptr, src_ptr, scale, n, BLOCK_SIZE: tl.constexpr):
    """Grid-stride ``dst += scale * src`` in fp32, rounded once to dst's dtype."""
    blk = tl.program_id(0).to(tl.int64)  # int64 offsets: buffers may pass 2**31 elements
    nprog = tl.num_programs(0).to(tl.int64)
    nblocks = tl.cdiv(n, BLOCK_SIZE)
    while blk < nblocks:  # a while loop: Triton 3.6's interpreter cannot range() here
        offs = blk * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
        d = tl.load(dst_ptr + offs, mask=mask).to(tl.float32)
        s = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
        tl.store(dst_ptr + offs, (d + scale * s).to(dst_ptr.dtype.element_ty), mask=mask)
        blk += nprog


def _geometry(config: LaunchConfig, kernel: str) -> tuple[int, int]:
    """``(grid, BLOCK_SIZE)`` from the launch config; a 1-D, power-of-two block is required."""
    block, grid = config.block, config.grid
    if block.y != 1 or block.z != 1 or grid.y != 1 or grid.z != 1:
        raise KernelError(
            f"{kernel} (triton): launch geometry must be 1-D, got grid {grid} block {block}; "
            "pass Dim3(x) for both"
        )
    if block.x & (block.x - 1):
        raise KernelError(
            f"{kernel} (triton): block.x = {block.x} is not a power of two; "
            f"use {triton.next_power_of_2(block.x)}"
        )
    return grid.x, block.x


def pack_bucket_triton(
    config: LaunchConfig, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """``pack_bucket`` as one Triton launch over the flat buffer (a table of source pointers)."""
    buffer, total = prepare_pack_bucket(tensors, out)
    grid, block = _geometry(config, "pack_bucket")
    if total == 0:
        return buffer
    if buffer.device.type != "cuda" or buffer.dtype not in _PACK_DTYPES:
        with torch.no_grad():
            torch.cat([t.reshape(-1) for t in tensors], out=buffer.narrow(0, 0, total))
        return buffer
    launch_pack(buffer, [t.detach().reshape(-1).contiguous() for t in tensors], grid, block)
    return buffer


def launch_pack(buffer: torch.Tensor, flats: list[torch.Tensor], grid: int, block: int) -> None:
    """Run the pack kernel: ``flats`` (contiguous, 1-D, buffer's dtype) copied in order."""
    sizes = [f.numel() for f in flats]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    device = buffer.device
    table = torch.tensor([f.data_ptr() for f in flats], dtype=torch.int64).to(device)
    bounds = torch.tensor(starts, dtype=torch.int64).to(device)
    _pack_kernel[(grid,)](buffer, table, bounds, len(flats), starts[-1], BLOCK_SIZE=block)


def scale_accumulate_triton(
    config: LaunchConfig, dst: torch.Tensor, src: torch.Tensor, scale: float
) -> torch.Tensor:
    """``scale_accumulate`` as one fused Triton pass (``dst += scale * src``, fp32 math)."""
    check_scale_accumulate_args(dst, src, scale)
    grid, block = _geometry(config, "scale_accumulate")
    if dst.numel() == 0:
        return dst
    if dst.device.type != "cuda" or dst.dtype not in _ACCUMULATE_DTYPES or not dst.is_contiguous():
        with torch.no_grad():
            dst.add_(src, alpha=scale)
        return dst
    launch_scale_accumulate(dst, src.contiguous(), float(scale), grid, block)
    return dst


def launch_scale_accumulate(
    dst: torch.Tensor, src: torch.Tensor, scale: float, grid: int, block: int
) -> None:
    """Run the accumulate kernel on contiguous ``dst`` and ``src`` of the same shape."""
    _scale_accumulate_kernel[(grid,)](dst, src, scale, dst.numel(), BLOCK_SIZE=block)


def register_triton_kernels(registry: KernelRegistry) -> None:
    """Register the Triton implementations in ``registry`` under backend ``"cuda"``."""
    registry.register("pack_bucket", BACKEND, pack_bucket_triton)
    registry.register("scale_accumulate", BACKEND, scale_accumulate_triton)
