"""Optional gradient codecs: fewer bytes on the wire for a bucket's all-reduce.

A cast codec (``bf16``, ``fp16``) turns a (pre-averaged) fp32 bucket into a narrower
wire tensor that is all-reduced in place and decoded back into the bucket. The ``fp8``
codec (:class:`Fp8Codec`) cannot be summed by the collective itself: it reduces in two
phases (:mod:`lamina.comm.fp8`), with error feedback. A codec is optional, so it can fail
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

import torch

from lamina.comm.fp8 import (
    BLOCK,
    Fp8Scatter,
    Fp8Settings,
    Fp8Sum,
    Quantized,
    dequantize,
    padded_numel,
    quantize,
)
from lamina.device.kernels import KernelLauncher
from lamina.errors import ConfigError, failure_reason

#: Where a two-phase codec compresses: every phase, or the inter-host phase only.
CODEC_SCOPES = ("all", "inter")
#: The exact reductions a two-phase codec's bucket falls back to.
FP8_FALLBACKS = ("fp32", "bf16")


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


class Fp8Codec(Codec):
    """e4m3 with one power-of-two scale per ``block`` elements, summed in two phases
    (:class:`~lamina.comm.fp8.Fp8Sum`): 0.252x fp32's bytes. ``error_feedback`` carries
    each rank's quantization residual into the next step; a bucket a rank flags (input
    not finite, a magnitude past ``overflow_at``, a quantization error past
    ``error_bound``) is reduced as ``fallback`` (``"fp32"`` or ``"bf16"``) that step.
    ``launcher`` runs the quantize kernels (the backend's, else the torch reference)."""

    name = "fp8"
    wire_dtype = torch.float8_e4m3fn
    tolerance = 2.0**-4  # 3 mantissa bits: half a step of 2**-3
    two_phase = True

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
        if not error_bound > 0 or not overflow_at > 0:
            raise ConfigError(
                f"fp8 error_bound={error_bound} and overflow_at={overflow_at} must be > 0"
            )
        if fallback not in FP8_FALLBACKS:
            raise ConfigError(f"fp8 fallback={fallback!r} is not one of {list(FP8_FALLBACKS)}")
        self.settings = Fp8Settings(block, error_feedback, error_bound, overflow_at, launcher)
        self.fallback = fallback

    def on_backend(self, launcher: KernelLauncher) -> Fp8Codec:
        """This codec quantizing with ``launcher``'s kernels, unless it was given a launcher."""
        return self if self.settings.launcher is not None else self.with_launcher(launcher)

    def with_launcher(self, launcher: KernelLauncher) -> Fp8Codec:
        """This codec's settings, running the kernels of ``launcher``."""
        codec = copy.copy(self)
        codec.settings = dataclasses.replace(self.settings, launcher=launcher)
        return codec

    def new_sum(self) -> Fp8Sum:
        """The per-bucket state of one bucket's two-phase sums."""
        return Fp8Sum(self.settings)

    def new_scatter(self) -> Fp8Scatter:
        """The per-unit state of one unit's fp8 reduce-scatters (ZeRO-3)."""
        return Fp8Scatter(self.settings)

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
    error = float(((out - probe).abs() / probe.abs().clamp(min=1e-3)).max())
    if not error <= codec.tolerance:
        return (
            f"codec {codec.name} round-trip error {error:.2e} exceeds its tolerance "
            f"{codec.tolerance:.2e}"
        )
    return ""
