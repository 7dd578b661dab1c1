"""Optional gradient codecs: fewer bytes on the wire for a bucket's all-reduce.

A cast codec (``bf16``, ``fp16``) turns a (pre-averaged) fp32 bucket into a narrower
wire tensor that is all-reduced in place and decoded back into the bucket. A
:class:`TwoPhaseCodec` (``fp8``: :class:`Fp8Codec`; plugins add others) cannot be summed
by the collective itself: it owns its sum (:mod:`lamina.comm.two_phase`), run in two
phases of its own collectives, with error feedback, and says what it hands to
``torch.distributed`` and keeps on each rank. A codec is optional, so it can fail
without stopping training: a codec that fails its self-check while planning is replaced
by the uncompressed all-reduce for the whole run, and a reduction that decodes to
non-finite values (fp16 overflow) is redone uncompressed for that bucket and step. The
reduced wire tensor is bitwise the same on every rank, so every rank takes that
decision the same way without exchanging anything.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from typing import Protocol

import torch

from lamina.comm.fp8 import (
    BLOCK,
    Fp8Scatter,
    Fp8Settings,
    Fp8Sum,
    Fp8Traced,
    Quantized,
    dequantize,
    padded_numel,
    quantize,
    quantized_bytes,
)
from lamina.comm.two_phase import TwoPhaseScatter, TwoPhaseSum
from lamina.device.kernels import KernelLauncher
from lamina.errors import ConfigError, failure_reason

#: Where a two-phase codec compresses: every phase, or the inter-host phase only.
CODEC_SCOPES = ("all", "inter")
#: The exact reductions a two-phase codec's bucket falls back to.
TWO_PHASE_FALLBACKS = ("fp32", "bf16")


class WrongWireSize(ValueError):
    """A codec's wire tensor does not hold one element per bucket element."""


class Codec(abc.ABC):
    """Encodes a bucket for the wire and decodes the reduced result back."""

    #: Name used in plans and by ``distribute(..., codec=...)``.
    name: str
    #: dtype of the wire tensor.
    wire_dtype: torch.dtype
    #: Largest relative round-trip error the self-check accepts.
    tolerance: float

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether buckets of ``dtype`` are compressed (wider than the wire dtype)."""
        return dtype.is_floating_point and dtype.itemsize > self.wire_dtype.itemsize

    #: True for a codec the collective cannot sum (it reduces in two phases).
    two_phase: bool = False

    @abc.abstractmethod
    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        """A new wire tensor holding ``bucket``."""

    @abc.abstractmethod
    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """Write the reduced ``wire`` tensor into ``out`` (the bucket)."""

    def on_backend(self, launcher: KernelLauncher) -> Codec:
        """This codec, running its kernels (if any) on ``launcher`` unless it names its own."""
        return self

    def round_trip_error(self, probe: torch.Tensor, decoded: torch.Tensor) -> float:
        """The self-check's error of ``decoded`` against ``probe``, compared with
        ``tolerance``: the largest error relative to each value (a float format's
        precision). A codec with another error model (block scales of fixed-point values)
        measures it its own way."""
        return float(((decoded - probe).abs() / probe.abs().clamp(min=1e-3)).max())

    def round_trip(self, bucket: torch.Tensor) -> torch.Tensor:
        """``bucket`` encoded and decoded again (the self-check's probe)."""
        wire = self.encode(bucket)
        if not isinstance(wire, torch.Tensor) or wire.numel() != bucket.numel():
            raise WrongWireSize(bucket.numel())
        out = torch.empty_like(bucket)
        self.decode(wire, out)
        return out


class CastCodec(Codec):
    """Casts to a narrower float type (``bf16``: fp32's range, ``fp16``: 3 more mantissa
    bits, overflows past 65504)."""

    def __init__(self, name: str, wire_dtype: torch.dtype, tolerance: float) -> None:
        self.name = name
        self.wire_dtype = wire_dtype
        self.tolerance = tolerance

    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        """``bucket`` cast to the wire dtype."""
        return bucket.to(self.wire_dtype)

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` <- ``wire`` cast back."""
        out.copy_(wire)


def check_two_phase_settings(
    codec: str, error_bound: float, overflow_at: float, fallback: str
) -> None:
    """ConfigError naming ``codec`` when a two-phase codec's bounds are not positive or
    its ``fallback`` is not an exact reduction lamina has."""
    if not error_bound > 0 or not overflow_at > 0:
        raise ConfigError(
            f"{codec} error_bound={error_bound} and overflow_at={overflow_at} must be > 0"
        )
    if fallback not in TWO_PHASE_FALLBACKS:
        raise ConfigError(
            f"{codec} fallback={fallback!r} is not one of {list(TWO_PHASE_FALLBACKS)}"
        )


class TracedBlocks(Protocol):
    """A two-phase codec's block quantization written for a captured graph: torch
    operations Dynamo traces, with the same math as the codec's eager sum, so a compiled
    step's sum (:mod:`lamina.strategies.compiled.graph_codecs`: the two phases as
    functional collectives, the flags, the error feedback) gives the eager sum's bits."""

    @property
    def block(self) -> int:
        """Elements per scale."""

    @property
    def error_feedback(self) -> bool:
        """Whether each rank carries its residuals into the next step."""

    @property
    def error_bound(self) -> float:
        """A quantization's relative L2 error past which a rank flags the bucket."""

    @property
    def overflow_at(self) -> float:
        """A magnitude past which a rank flags the bucket."""

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The 1-D fp32 ``values`` (whole blocks) as ``(payload, scales)``: one payload
        element per value and one scale per block, in dtypes the process group carries."""

    def dequantize(self, payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The fp32 values of ``(payload, scales)`` (1-D)."""

    def flagged(
        self, payload: torch.Tensor, scales: torch.Tensor, flag: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The wire tensors marked, where the 0-d bool ``flag`` is set, as the eager sum
        marks them: a NaN every rank decodes, so the bucket falls back everywhere."""

    def residuals(
        self, eager: TwoPhaseSum, padded: int, world: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residuals the eager sum ``eager`` holds: its contribution's (``padded``
        elements) and its owned chunk's (``padded / world``), zeros where it holds none."""

    def hold(self, eager: TwoPhaseSum, residual: torch.Tensor, owned: torch.Tensor) -> None:
        """Make ``eager`` hold ``residual`` and ``owned`` (a compiled step updates them in
        place at fixed addresses; an eager step goes on from them)."""


class TwoPhaseCodec(Codec):
    """A codec that sums in two phases of its own collectives (the collective cannot sum
    its wire form). ``fallback`` is the exact reduction (``"fp32"`` or ``"bf16"``) a bucket
    takes the step a rank flags it; ``error_feedback`` whether it keeps residuals."""

    two_phase = True
    fallback: str = "fp32"
    error_feedback: bool = True

    def traced(self) -> TracedBlocks | None:
        """This codec's quantization for a captured graph (None: it has none, and a
        compiled step with one of its buckets runs eagerly, naming the codec)."""
        return None

    @abc.abstractmethod
    def new_sum(self, exact: tuple[int, int] | None = None) -> TwoPhaseSum:
        """The per-bucket state of one bucket's two-phase sums. Elements ``exact`` (start,
        stop) of the buffer are counts that must arrive exactly (ZeRO-3's used-flags): a
        codec whose blocks would lose them beside small values sends them apart."""

    @abc.abstractmethod
    def wire(self, numel: int, world_size: int, exact_numel: int = 0) -> dict[str, int]:
        """Bytes per dtype one sum of ``numel`` elements over ``world_size`` ranks hands to
        ``torch.distributed`` (over both phases; a gather counted as its output), with
        ``exact_numel`` of them given as ``exact``."""

    @abc.abstractmethod
    def nbytes(self, numel: int, world_size: int) -> int:
        """Bytes of the buffer as it travels (what a ring would carry instead of the
        bucket's own bytes): the payload with its scales, padded as the sum pads it."""

    @abc.abstractmethod
    def residual_bytes(self, numel: int, world_size: int) -> int:
        """Bytes the error feedback of one sum of ``numel`` elements keeps on each rank."""

    @abc.abstractmethod
    def new_scatter(self, exact: tuple[int, int] | None = None) -> TwoPhaseScatter:
        """The per-unit state of one unit's reduce-scatters (ZeRO-3's gradient); ``exact``
        as for :meth:`new_sum`, in each slot."""

    @abc.abstractmethod
    def scatter_wire(self, numel: int, world_size: int, exact_numel: int = 0) -> dict[str, int]:
        """Bytes per dtype one reduce-scatter of ``numel`` elements (``world_size`` slots,
        ``exact_numel`` of each given as ``exact``) hands to ``torch.distributed``."""

    @abc.abstractmethod
    def scatter_residual_bytes(self, numel: int, world_size: int) -> int:
        """Bytes the error feedback of one reduce-scatter of ``numel`` elements keeps."""


class Fp8Codec(TwoPhaseCodec):
    """e4m3 with one power-of-two scale per ``block`` elements, summed in two phases
    (:class:`~lamina.comm.fp8.Fp8Sum`): 0.252x fp32's bytes. ``error_feedback`` carries
    each rank's quantization residual into the next step; a bucket a rank flags (input
    not finite, a magnitude past ``overflow_at``, a quantization error past
    ``error_bound``) is reduced as ``fallback`` (``"fp32"`` or ``"bf16"``) that step.
    ``launcher`` runs the quantize kernels (the backend's, else the torch reference)."""

    name = "fp8"
    wire_dtype = torch.float8_e4m3fn
    tolerance = 2.0**-4  # 3 mantissa bits: half a step of 2**-3

    def __init__(
        self,
        *,
        error_feedback: bool = True,
        block: int = BLOCK,
        error_bound: float = 0.1,
        overflow_at: float = float("inf"),
        fallback: str = "fp32",
        launcher: KernelLauncher | None = None,
    ) -> None:
        if block < 1 or block & (block - 1):
            raise ConfigError(f"fp8 block={block} must be a power of two (128 is measured)")
        check_two_phase_settings(self.name, error_bound, overflow_at, fallback)
        self.settings = Fp8Settings(block, error_feedback, error_bound, overflow_at, launcher)
        self.fallback = fallback
        self.error_feedback = error_feedback

    def on_backend(self, launcher: KernelLauncher) -> Fp8Codec:
        """This codec quantizing with ``launcher``'s kernels, unless it was given a launcher."""
        return self if self.settings.launcher is not None else self.with_launcher(launcher)

    def with_launcher(self, launcher: KernelLauncher) -> Fp8Codec:
        """This codec's settings, running the kernels of ``launcher``."""
        codec = copy.copy(self)
        codec.settings = dataclasses.replace(self.settings, launcher=launcher)
        return codec

    def new_sum(self, exact: tuple[int, int] | None = None) -> Fp8Sum:
        """The per-bucket state of one bucket's two-phase sums (counts travel in the
        payload: e4m3 with a power-of-two block scale keeps 0/1 flags and their means
        exact beside small values, so ``exact`` needs nothing apart)."""
        return Fp8Sum(self.settings)

    def traced(self) -> Fp8Traced:
        """The e4m3 block quantization as a captured graph runs it: the torch reference
        kernels' math (the conformance kit holds a backend's kernels to it, bit for bit)."""
        settings = self.settings
        return Fp8Traced(
            settings.block, settings.error_feedback, settings.error_bound, settings.overflow_at
        )

    def wire(self, numel: int, world_size: int, exact_numel: int = 0) -> dict[str, int]:
        """The e4m3 payload (``uint8``) and one ``int8`` exponent per block, twice."""
        return Fp8Sum.wire(numel, world_size, self.settings.block)

    def nbytes(self, numel: int, world_size: int) -> int:
        """Payload and exponents of the padded buffer: 0.252x fp32's with 128-blocks."""
        return quantized_bytes(numel, world_size, self.settings.block)

    def residual_bytes(self, numel: int, world_size: int) -> int:
        """The contribution's and the owned chunk's fp32 residuals (0 without feedback)."""
        if not self.settings.error_feedback:
            return 0
        return Fp8Sum.residual_bytes(numel, world_size, self.settings.block)

    def new_scatter(self, exact: tuple[int, int] | None = None) -> Fp8Scatter:
        """The per-unit state of one unit's fp8 reduce-scatters (ZeRO-3; ``exact`` as for
        :meth:`new_sum`)."""
        return Fp8Scatter(self.settings)

    def scatter_wire(self, numel: int, world_size: int, exact_numel: int = 0) -> dict[str, int]:
        """The payload of ``world_size`` slots padded to whole blocks and its exponents."""
        return Fp8Scatter.wire(numel, world_size, self.settings.block)

    def scatter_residual_bytes(self, numel: int, world_size: int) -> int:
        """The fp32 residual of the padded slots (0 without feedback)."""
        if not self.settings.error_feedback:
            return 0
        return Fp8Scatter.residual_bytes(numel, world_size, self.settings.block)

    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        """``bucket`` as one ``uint8`` wire tensor: the e4m3 payload (padded to whole
        blocks) followed by one exponent byte per block. A collective cannot sum it: the
        reduction runs :meth:`new_sum`; this form is for the self-check and inspection."""
        padded = torch.zeros(
            padded_numel(bucket.numel(), 1, self.settings.block),
            dtype=torch.float32,
            device=bucket.device,
        )
        padded[: bucket.numel()].copy_(bucket.reshape(-1))
        q = quantize(padded, self.settings.block, launcher=self.settings.launcher)
        return torch.cat([q.payload, q.exponents.view(torch.uint8)])

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` <- the values of an :meth:`encode` wire tensor."""
        block = self.settings.block
        padded = wire.numel() * block // (block + 1)
        payload, exponents = wire[:padded], wire[padded:].view(torch.int8)
        decoded = dequantize(Quantized(payload, exponents, block), launcher=self.settings.launcher)
        out.copy_(decoded[: out.numel()].view_as(out))

    def round_trip(self, bucket: torch.Tensor) -> torch.Tensor:
        """``bucket`` encoded with its block scales and decoded (the wire holds more
        elements than the bucket: the padding and the exponents)."""
        out = torch.empty_like(bucket)
        self.decode(self.encode(bucket), out)
        return out


#: The codecs built in, by name (lamina.strategies.codec_registry adds the plugins').
BUILTIN_CODECS: dict[str, Codec] = {
    "bf16": CastCodec("bf16", torch.bfloat16, 2.0**-8),
    "fp16": CastCodec("fp16", torch.float16, 2.0**-11),
    "fp8": Fp8Codec(),
}


def self_check(codec: Codec, dtype: torch.dtype, device: torch.device) -> str:
    """Round-trip a probe bucket through ``codec``; '' when it works, else the reason."""
    probe = torch.linspace(-4.0, 4.0, 1031, dtype=torch.float32).to(dtype=dtype, device=device)
    try:
        out = codec.round_trip(probe)
    except WrongWireSize:
        return f"codec {codec.name} encoded a {probe.numel()}-element bucket wrongly"
    except Exception as exc:
        return f"codec {codec.name} failed its self-check: {failure_reason(exc)}"
    error = codec.round_trip_error(probe, out)
    if not error <= codec.tolerance:
        return (
            f"codec {codec.name} round-trip error {error:.2e} exceeds its tolerance "
            f"{codec.tolerance:.2e}"
        )
    return ""
