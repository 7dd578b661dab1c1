"""int8 with one absmax scale per block, summed in two phases with error feedback.

Quantizing a block ``b`` of ``block`` elements: ``scale = max|b| / 127`` (fp32),
``payload = round(b / scale)`` in ``int8``; decoding is ``payload * scale``. The sum of
one buffer over ``P`` ranks (:class:`Int8Sum`):

1. every rank quantizes its buffer (padded to ``P`` chunks of whole blocks) plus the
   residual it kept from the last step;
2. ``all_to_all`` hands rank ``r`` the ``r``-th chunk of every rank's payload and scales;
3. rank ``r`` decodes the ``P`` chunks and sums them in fp32, quantizes its summed chunk
   again (plus the residual it kept of its chunk);
4. every rank gathers the quantized chunks and decodes them: the same bits everywhere.

Bytes per phase: ``n`` int8 plus ``4 n / block`` of scales, against fp32's ``4 n``:
0.258x with 128-element blocks. A rank whose input is not finite, passes
``overflow_at``, or quantizes with a relative L2 error past ``error_bound`` writes a NaN
scale into its first block: the NaN survives the sum and the gather, so every rank
decodes a non-finite result the same step and the bucket falls back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lamina.comm.codecs import TwoPhaseCodec, check_two_phase_settings
from lamina.comm.two_phase import QuantizationCounts, SumStats, TwoPhaseSum, all_gather_slots
from lamina.errors import ConfigError
from lamina.works import AllWorks

#: Elements per scale.
BLOCK = 128
#: The largest payload magnitude (symmetric: -127..127, so that negation is exact).
LEVELS = 127


@dataclass(frozen=True)
class Int8Blocks:
    """A buffer in int8: ``payload`` (one per element) and one fp32 ``scales`` per block."""

    payload: torch.Tensor
    scales: torch.Tensor
    block: int


def padded_numel(numel: int, world_size: int, block: int = BLOCK) -> int:
    """``numel`` padded to ``world_size`` chunks of whole blocks."""
    unit = world_size * block
    return -(-numel // unit) * unit


def quantize(values: torch.Tensor, block: int = BLOCK) -> Int8Blocks:
    """``values`` (1-D fp32, whole blocks) as int8 with one absmax scale per block."""
    blocks = values.view(-1, block)
    scales = blocks.abs().amax(dim=1) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    payload = torch.round(blocks / safe[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return Int8Blocks(payload.view(-1), scales, block)


def dequantize(q: Int8Blocks) -> torch.Tensor:
    """The fp32 values of ``q`` (a NaN scale decodes its whole block as NaN)."""
    blocks = q.payload.view(-1, q.block).to(torch.float32)
    return (blocks * q.scales[:, None]).view(-1)


def handed_bytes(padded: int, block: int, phases: int) -> dict[str, int]:
    """Bytes per dtype handed to ``torch.distributed`` for ``padded`` quantized elements in
    ``phases`` collectives: the int8 payload and one fp32 scale per block, each time."""
    return {"int8": phases * padded, "float32": phases * 4 * (padded // block)}


@dataclass
class _Side:
    """One quantization of a sum, kept on the device until :meth:`Int8Sum.stats`."""

    q: Int8Blocks
    residual: torch.Tensor
    error: torch.Tensor
    largest: torch.Tensor
    flag: torch.Tensor


class Int8Sum:
    """The two-phase int8 sum of one buffer, step after step, with its error feedback
    (a :class:`~lamina.comm.two_phase.TwoPhaseSum`)."""

    def __init__(self, codec: Int8Codec, exact: tuple[int, int] | None = None) -> None:
        self.codec = codec
        #: elements sent exactly (fp32) beside the blocks: counts such as used-flags,
        #: which a block's absmax scale would round away beside small gradients
        self.exact = exact
        self._residual: torch.Tensor | None = None
        self._owned: torch.Tensor | None = None
        #: the last sum's two quantizations (the second absent for a reduce-scatter)
        self.last: tuple[_Side, _Side | None] | None = None

    def quantize_side(
        self, values: torch.Tensor, residual: torch.Tensor | None, overflow_at: float | None = None
    ) -> _Side:
        """``values`` (plus ``residual``) quantized; ``values`` becomes the new residual.
        A flagged side (past ``overflow_at``, default the codec's) carries a NaN in its
        first scale."""
        bound = self.codec.overflow_at if overflow_at is None else overflow_at
        if residual is not None:
            values.add_(residual)
        q = quantize(values, self.codec.block)
        low, high = torch.aminmax(values)
        largest = torch.maximum(-low, high)
        norm = values.norm()
        values.sub_(dequantize(q))  # now the residual
        error = torch.where(norm > 0, values.norm() / norm, torch.zeros_like(norm))
        flag = ~torch.isfinite(largest) | (largest > bound) | (error > self.codec.error_bound)
        q.scales[:1] = torch.where(flag, torch.full_like(q.scales[:1], math.nan), q.scales[:1])
        return _Side(q, values, error, largest, flag)

    def run(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The sum of the 1-D float ``tensor`` over ``group`` (a new padded fp32 tensor);
        ``tensor`` is not written."""
        world, rank, block = dist.get_world_size(group), dist.get_rank(group), self.codec.block
        padded = padded_numel(tensor.numel(), world, block)
        source = torch.zeros(padded, dtype=torch.float32, device=tensor.device)
        source[: tensor.numel()].copy_(tensor.detach().reshape(-1))
        exact = None
        if self.exact is not None:
            start, stop = self.exact
            exact = source[start:stop].clone()
            dist.all_reduce(exact, group=group)
            source[start:stop] = 0.0  # out of the blocks: they would not hold it exactly
        chunk = padded // world
        feedback = self.codec.error_feedback
        if feedback and (self._residual is None or self._residual.numel() != padded):
            self._residual = torch.zeros_like(source)
            self._owned = torch.zeros(chunk, dtype=torch.float32, device=tensor.device)
        mine = self.quantize_side(source, self._residual if feedback else None)
        payload = torch.empty_like(mine.q.payload)
        scales = torch.empty_like(mine.q.scales)
        dist.all_to_all_single(payload, mine.q.payload, group=group)
        dist.all_to_all_single(scales, mine.q.scales, group=group)
        summed = dequantize(Int8Blocks(payload, scales, block)).view(world, chunk).sum(dim=0)
        reduced = self.quantize_side(summed, self._owned if feedback else None)
        self.last = (mine, reduced)
        all_gather_slots(payload, reduced.q.payload, rank, world, group)
        all_gather_slots(scales, reduced.q.scales, rank, world, group)
        result = dequantize(Int8Blocks(payload, scales, block))
        if exact is not None and self.exact is not None:
            result[self.exact[0] : self.exact[1]] = exact
        return result

    def feedback(
        self, padded: int, world: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residuals held now for a ``padded``-element buffer over ``world`` ranks:
        the contribution's and the owned chunk's (zeros where none are held yet)."""
        if self._residual is None or self._owned is None or self._residual.numel() != padded:
            self._residual = torch.zeros(padded, dtype=torch.float32, device=device)
            self._owned = torch.zeros(padded // world, dtype=torch.float32, device=device)
        return self._residual, self._owned

    def hold(self, residual: torch.Tensor, owned: torch.Tensor) -> None:
        """Hold ``residual`` and ``owned`` as the residuals (a compiled step's tensors)."""
        self._residual, self._owned = residual, owned

    def commit(self, ok: bool) -> None:
        """Keep the last sum's residuals (its result was used) or drop them."""
        if ok and self.last is not None and self.codec.error_feedback:
            mine, reduced = self.last
            self._residual = mine.residual
            if reduced is not None:
                self._owned = reduced.residual

    def stats(self) -> SumStats:
        """What the last :meth:`run` saw on this rank (waits for the device)."""
        if self.last is None:
            return SumStats()
        mine, reduced = self.last
        sides = [(mine, "its input")] + ([(reduced, "its summed chunk")] if reduced else [])
        stats = SumStats(QuantizationCounts(), float(mine.error), float(sides[-1][0].error))
        for side, label in sides:
            not_finite = int((~torch.isfinite(side.residual)).sum())
            zeros = (side.q.payload == 0) & (side.residual != 0)
            stats.counts.add(QuantizationCounts(not_finite, int(zeros.sum())))
            if stats.flagged:
                continue
            if not math.isfinite(float(side.largest)):
                stats.flagged = "its input is not finite" if side is mine else ""
            elif float(side.largest) > self.codec.overflow_at:
                stats.flagged = f"{label} passes overflow_at={self.codec.overflow_at:g}"
            elif float(side.error) > self.codec.error_bound:
                stats.flagged = (
                    f"{label} quantizes with error {float(side.error):.2e} > "
                    f"error_bound={self.codec.error_bound:g}"
                )
        return stats

    def residual_nbytes(self) -> int:
        """Bytes of the residuals held now."""
        held = (self._residual, self._owned)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


class Int8Scatter:
    """The int8 reduce-scatter of one buffer of ``P`` rank-major slots, step after step,
    with error feedback: the first phase of :class:`Int8Sum` alone (ZeRO-3's gradient; a
    :class:`~lamina.comm.two_phase.TwoPhaseScatter`). A rank that flags the buffer writes
    a NaN scale into every slot, so every rank's slot decodes non-finite the same step;
    an input past ``float32 max / P`` is flagged too (its sum could overflow)."""

    def __init__(self, codec: Int8Codec, exact: tuple[int, int] | None = None) -> None:
        self._sum = Int8Sum(codec)
        self.exact = exact  # in each slot, sent exactly beside the blocks
        self._residual: torch.Tensor | None = None

    def start(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> tuple[Any, Callable[[], torch.Tensor]]:
        """Start summing the ``P`` slots of the 1-D ``tensor`` over ``group``: the work and
        a function giving this rank's summed slot (fp32, ``numel / P``)."""
        codec = self._sum.codec
        world, block = dist.get_world_size(group), codec.block
        slot = tensor.numel() // world
        padded_slot = -(-slot // block) * block
        source = torch.zeros(world, padded_slot, dtype=torch.float32, device=tensor.device)
        source[:, :slot].copy_(tensor.detach().view(world, slot))
        works_exact, exact_in, exact_out = [], None, None
        if self.exact is not None:
            start, stop = self.exact
            exact_in = source[:, start:stop].contiguous()
            exact_out = torch.empty_like(exact_in)
            works_exact.append(
                dist.all_to_all_single(exact_out, exact_in, group=group, async_op=True)
            )
            source[:, start:stop] = 0.0
        flat = source.view(-1)
        if codec.error_feedback and (
            self._residual is None or self._residual.numel() != flat.numel()
        ):
            self._residual = torch.zeros_like(flat)
        mine = self._sum.quantize_side(
            flat,
            self._residual if codec.error_feedback else None,
            min(codec.overflow_at, torch.finfo(torch.float32).max / world),
        )
        scales = mine.q.scales.view(world, padded_slot // block)
        scales[:, 0] = torch.where(mine.flag, math.nan, scales[:, 0])  # every slot
        self._sum.last = (mine, None)
        payload = torch.empty_like(mine.q.payload)
        received = torch.empty_like(mine.q.scales)
        works = AllWorks(
            [
                *works_exact,
                dist.all_to_all_single(payload, mine.q.payload, group=group, async_op=True),
                dist.all_to_all_single(received, mine.q.scales, group=group, async_op=True),
            ]
        )
        exact = self.exact

        def summed() -> torch.Tensor:
            values = dequantize(Int8Blocks(payload, received, block)).view(world, padded_slot)
            out = values.sum(dim=0)[:slot]
            if exact is not None and exact_out is not None:
                out[exact[0] : exact[1]] = exact_out.sum(dim=0)
            return out

        return works, summed

    def commit(self, ok: bool) -> None:
        """Keep (``ok``) or drop the last call's residual."""
        if ok and self._sum.last is not None and self._sum.codec.error_feedback:
            self._residual = self._sum.last[0].residual

    def stats(self) -> SumStats:
        """What the last :meth:`start` saw on this rank."""
        return self._sum.stats()

    def residual_nbytes(self) -> int:
        """Bytes of the residual held now."""
        held = self._residual
        return 0 if held is None else held.numel() * held.element_size()


@dataclass(frozen=True)
class Int8Traced:
    """The int8 block quantization of :class:`Int8Sum` for a captured graph (a
    :class:`lamina.comm.codecs.TracedBlocks`): :func:`quantize` and :func:`dequantize`
    themselves, the flag written as a NaN first scale."""

    block: int
    error_feedback: bool
    error_bound: float
    overflow_at: float

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` (1-D fp32, whole blocks) as int8 payload and fp32 block scales."""
        q = quantize(values, self.block)
        return q.payload, q.scales

    def dequantize(self, payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The fp32 values of ``payload`` with its block ``scales``."""
        return dequantize(Int8Blocks(payload, scales, self.block))

    def flagged(
        self, payload: torch.Tensor, scales: torch.Tensor, flag: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``scales`` with a NaN first scale where ``flag`` is set."""
        first = torch.where(flag, torch.full_like(scales[:1], math.nan), scales[:1])
        return payload, torch.cat([first, scales[1:]])

    def residuals(
        self, eager: TwoPhaseSum, padded: int, world: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residuals of the :class:`Int8Sum` ``eager`` (see :meth:`Int8Sum.feedback`)."""
        return _int8_sum(eager).feedback(padded, world, device)

    def hold(self, eager: TwoPhaseSum, residual: torch.Tensor, owned: torch.Tensor) -> None:
        """Make the :class:`Int8Sum` ``eager`` hold these residuals."""
        _int8_sum(eager).hold(residual, owned)


def _int8_sum(eager: TwoPhaseSum) -> Int8Sum:
    if not isinstance(eager, Int8Sum) or eager.exact is not None:
        raise TypeError(
            f"int8's traced sum shares the residuals of an Int8Sum without exact elements, "
            f"got {type(eager).__name__}"
        )
    return eager


class Int8Codec(TwoPhaseCodec):
    """int8 with one absmax scale per ``block`` elements, summed in two phases: 0.258x
    fp32's bytes with 128-element blocks, one quantization's relative L2 error about
    6e-3 on Gaussian values. ``error_feedback`` carries each rank's residuals into the
    next step; a bucket a rank flags (input not finite, a magnitude past
    ``overflow_at``, a quantization error past ``error_bound``) is reduced as
    ``fallback`` (``"fp32"`` or ``"bf16"``) that step."""

    name = "int8"
    wire_dtype = torch.int8
    #: The self-check's bound on an error relative to its block's largest magnitude:
    #: rounding is half a step of 1/127 of it (3.9e-3), with a 2x margin.
    tolerance = 2.0**-7

    def __init__(
        self,
        *,
        block: int = BLOCK,
        error_feedback: bool = True,
        error_bound: float = 0.1,
        overflow_at: float = float("inf"),
        fallback: str = "fp32",
    ) -> None:
        if block < 1:
            raise ConfigError(f"int8 block={block} must be at least 1 (128 is measured)")
        check_two_phase_settings(self.name, error_bound, overflow_at, fallback)
        self.block = block
        self.error_feedback = error_feedback
        self.error_bound = error_bound
        self.overflow_at = overflow_at
        self.fallback = fallback

    def traced(self) -> Int8Traced:
        """The int8 block quantization as a captured graph runs it (the same functions)."""
        return Int8Traced(self.block, self.error_feedback, self.error_bound, self.overflow_at)

    def new_sum(self, exact: tuple[int, int] | None = None) -> Int8Sum:
        """One bucket's sums (``exact``: elements all-reduced apart, in fp32)."""
        return Int8Sum(self, exact)

    def new_scatter(self, exact: tuple[int, int] | None = None) -> Int8Scatter:
        """One unit's reduce-scatters (ZeRO-3; ``exact``: per slot, sent apart in fp32)."""
        return Int8Scatter(self, exact)

    def scatter_wire(self, numel: int, world_size: int, exact_numel: int = 0) -> dict[str, int]:
        """The payload of ``world_size`` slots padded to whole blocks and their scales, in
        one all_to_all, and each slot's exact elements in fp32 in another."""
        slot = -(-(numel // world_size) // self.block) * self.block
        handed = handed_bytes(world_size * slot, self.block, 1)
        handed["float32"] += 4 * world_size * exact_numel
        return handed

    def scatter_residual_bytes(self, numel: int, world_size: int) -> int:
        """The fp32 residual of the padded slots (0 without feedback)."""
        if not self.error_feedback:
            return 0
        return 4 * world_size * -(-(numel // world_size) // self.block) * self.block

    def wire(self, numel: int, world_size: int, exact_numel: int = 0) -> dict[str, int]:
        """The int8 payload and the fp32 scales of the padded buffer, in both phases, and
        the exact elements' fp32 all-reduce."""
        handed = handed_bytes(padded_numel(numel, world_size, self.block), self.block, 2)
        handed["float32"] += 4 * exact_numel
        return handed

    def nbytes(self, numel: int, world_size: int) -> int:
        """Payload and scales of the padded buffer."""
        padded = padded_numel(numel, world_size, self.block)
        return padded + 4 * (padded // self.block)

    def residual_bytes(self, numel: int, world_size: int) -> int:
        """fp32 residuals of the contribution and of the owned chunk (0 without feedback)."""
        if not self.error_feedback:
            return 0
        padded = padded_numel(numel, world_size, self.block)
        return 4 * (padded + padded // world_size)

    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        """``bucket`` as one int8 wire tensor (payload, then each fp32 scale's 4 bytes): for
        the self-check and inspection; the reduction runs :meth:`new_sum`."""
        padded = torch.zeros(padded_numel(bucket.numel(), 1, self.block), device=bucket.device)
        padded[: bucket.numel()].copy_(bucket.reshape(-1))
        q = quantize(padded, self.block)
        return torch.cat([q.payload, q.scales.view(torch.int8)])

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` <- the values of an :meth:`encode` wire tensor."""
        padded = wire.numel() * self.block // (self.block + 4)
        q = Int8Blocks(wire[:padded], wire[padded:].view(torch.float32), self.block)
        out.copy_(dequantize(q)[: out.numel()].view_as(out))

    def round_trip_error(self, probe: torch.Tensor, decoded: torch.Tensor) -> float:
        """The largest error relative to its block's largest magnitude (a fixed-point
        format within each block: small values keep the block's absolute step)."""
        n = probe.numel()
        padded = padded_numel(n, 1, self.block)
        error = torch.zeros(padded, device=probe.device)
        largest = torch.zeros(padded, device=probe.device)
        error[:n] = (decoded - probe).abs().reshape(-1).float()
        largest[:n] = probe.abs().reshape(-1).float()
        per_block = largest.view(-1, self.block).amax(dim=1).clamp(min=1e-30)
        return float((error.view(-1, self.block).amax(dim=1) / per_block).max())

    def round_trip(self, bucket: torch.Tensor) -> torch.Tensor:
        """``bucket`` encoded with its block scales and decoded (the wire holds more
        elements than the bucket: the padding and the scales)."""
        out = torch.empty_like(bucket)
        self.decode(self.encode(bucket), out)
        return out
