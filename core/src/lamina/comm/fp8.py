"""FP8 (e4m3) gradient reduction in two phases, with block-wise power-of-two scales.

A sum of FP8 values cannot be taken in FP8 by the collective itself, so the reduction
is restructured around collectives that only move bytes:

1. every rank quantizes its buffer (:func:`quantize`): blocks of :data:`BLOCK` elements,
   each scaled by a power of two so that its largest magnitude lands at or under e4m3's
   448, cast to ``float8_e4m3fn`` and sent as a ``uint8`` view, with one ``int8``
   exponent per block;
2. ``all_to_all`` hands rank ``r`` the ``r``-th of ``P`` chunks of every rank's payload
   and exponents (the reduce-scatter phase);
3. rank ``r`` dequantizes the ``P`` chunks and sums them in fp32;
4. it quantizes its summed chunk again and every rank all-gathers the quantized chunks
   (the all-gather phase) and dequantizes them.

Each phase moves ``(P-1)/P`` of ``n + n/BLOCK`` bytes per rank where a ring all-reduce of
fp32 moves ``(P-1)/P`` of ``4n`` per phase: 0.252x the bytes with 128-element blocks.
Every rank decodes the same gathered bytes, so the result is bitwise equal on every rank.

Precision: e4m3 keeps 3 mantissa bits, so one quantization has a relative L2 error of
about 2.6e-2 whatever the block size (the block scale only sets the exponent range;
measured on Gaussian and on mixed-magnitude data, blocks of 32 to 256). The reduction
quantizes twice; the error of the first quantization averages over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lamina.errors import ConfigError

#: Elements per scaled block.
BLOCK = 128
#: Largest finite magnitude of ``float8_e4m3fn``.
E4M3_MAX = 448.0
#: Exponent bounds of a block scale (it travels as an int8).
MIN_EXPONENT, MAX_EXPONENT = -127, 127


@dataclass(frozen=True)
class Quantized:
    """A buffer in e4m3: ``payload`` (``uint8``, the e4m3 bits, one per element) and one
    ``int8`` exponent per block of ``block`` elements: element ``i`` is
    ``e4m3(payload[i]) * 2 ** -exponents[i // block]``."""

    payload: torch.Tensor
    exponents: torch.Tensor
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes of the payload and the exponents."""
        return self.payload.numel() + self.exponents.numel()


@dataclass
class QuantizationCounts:
    """What quantizing lost: non-finite inputs (``overflow``: they cannot be encoded and
    decode as NaN) and nonzero inputs that became zero (``underflow``)."""

    overflow: int = 0
    underflow: int = 0

    def add(self, other: QuantizationCounts) -> None:
        """Add ``other``'s counts to these."""
        self.overflow += other.overflow
        self.underflow += other.underflow


def _check_block(numel: int, block: int) -> None:
    if block < 1 or numel % block:
        raise ConfigError(
            f"fp8 quantization needs whole blocks: {numel} elements in blocks of {block}; "
            "pad the buffer to a multiple of the block"
        )


def quantize(
    x: torch.Tensor, block: int = BLOCK, counts: QuantizationCounts | None = None
) -> Quantized:
    """``x`` (1-D, float, a multiple of ``block`` elements) in e4m3 with one power-of-two
    scale per block; ``counts`` (if given) gets what was lost."""
    _check_block(x.numel(), block)
    blocks = x.detach().reshape(-1, block).float()
    amax = blocks.abs().amax(dim=1, keepdim=True)
    finite = torch.isfinite(amax)
    safe = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
    exponent = torch.floor(torch.log2(E4M3_MAX / safe)).clamp(MIN_EXPONENT, MAX_EXPONENT)
    # log2 may round up by one ulp: step back where the block would pass 448
    exponent = exponent - (torch.ldexp(safe, exponent) > E4M3_MAX).float()
    scaled = torch.ldexp(blocks, exponent)
    payload = scaled.to(torch.float8_e4m3fn)
    if counts is not None:
        counts.overflow += int((~torch.isfinite(blocks)).sum())
        counts.underflow += int(((blocks != 0) & (payload.float() == 0)).sum())
    return Quantized(
        payload.view(torch.uint8).reshape(-1),
        exponent.to(torch.int8).reshape(-1),
        block,
    )


def dequantize(q: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of ``q`` (written into ``out`` when given)."""
    values = q.payload.view(torch.float8_e4m3fn).float().reshape(-1, q.block)
    exponent = q.exponents.float().reshape(-1, 1)
    decoded = torch.ldexp(values, -exponent).reshape(-1)
    if out is None:
        return decoded
    out.copy_(decoded)
    return out


def padded_numel(numel: int, world_size: int, block: int = BLOCK) -> int:
    """The length a buffer of ``numel`` elements is padded to for the two phases: whole
    blocks in each of the ``world_size`` chunks."""
    unit = world_size * block
    return -(-numel // unit) * unit


def wire_bytes(numel: int, world_size: int, block: int = BLOCK) -> int:
    """Bytes one rank sends in the two phases for a buffer of ``numel`` elements."""
    padded = padded_numel(numel, world_size, block)
    per_phase = (world_size - 1) * (padded + padded // block) // world_size
    return 2 * per_phase


def all_reduce_fp8(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    block: int = BLOCK,
    counts: QuantizationCounts | None = None,
) -> torch.Tensor:
    """Sum the 1-D float ``tensor`` over ``group`` in place through the two phases (see
    the module docstring) and return it; ``counts`` gets what both quantizations lost on
    this rank. Every rank of ``group`` must call it with the same ``numel``."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world == 1:
        return tensor
    padded = padded_numel(tensor.numel(), world, block)
    source = tensor.detach().float()
    if padded != tensor.numel():
        source = torch.cat([source, source.new_zeros(padded - tensor.numel())])
    mine = quantize(source, block, counts)
    # reduce-scatter phase: chunk r of every rank's payload and exponents to rank r
    payload = torch.empty_like(mine.payload)
    exponents = torch.empty_like(mine.exponents)
    dist.all_to_all_single(payload, mine.payload, group=group)
    dist.all_to_all_single(exponents, mine.exponents, group=group)
    chunk = padded // world
    received = dequantize(Quantized(payload, exponents, block)).view(world, chunk)
    summed = received.sum(dim=0)
    # all-gather phase: every rank's summed chunk, quantized once by its owner
    reduced = quantize(summed, block, counts)
    gathered_payload = torch.empty_like(mine.payload)
    gathered_exponents = torch.empty_like(mine.exponents)
    _all_gather(gathered_payload, reduced.payload, rank, world, group)
    _all_gather(gathered_exponents, reduced.exponents, rank, world, group)
    result = dequantize(Quantized(gathered_payload, gathered_exponents, block))
    tensor.copy_(result[: tensor.numel()].to(tensor.dtype))
    return tensor


def _all_gather(
    out: torch.Tensor, part: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup | None
) -> None:
    """``out`` <- every rank's ``part`` in rank order (one broadcast per rank on gloo,
    whose all_gather is the slower form; the native op elsewhere)."""
    if dist.get_backend(group) != "gloo":
        dist.all_gather_into_tensor(out, part, group=group)
        return
    slots = out.view(world, part.numel())
    slots[rank].copy_(part)
    works = [
        dist.broadcast(
            slot,
            src=k if group is None else dist.get_global_rank(group, k),
            group=group,
            async_op=True,
        )
        for k, slot in enumerate(slots)
    ]
    for work in works:
        work.wait()  # type: ignore[union-attr]
