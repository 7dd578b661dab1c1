"""Optional gradient codecs: fewer bytes on the wire for a bucket's all-reduce.

A codec turns a (pre-averaged) fp32 bucket into a narrower wire tensor that is
all-reduced in place and decoded back into the bucket. It is optional, so it can fail
without stopping training: a codec that fails its self-check while planning is replaced
by the uncompressed all-reduce for the whole run, and a reduction that decodes to
non-finite values (fp16 overflow) is redone uncompressed for that bucket and step. The
reduced wire tensor is bitwise the same on every rank, so every rank takes that
decision the same way without exchanging anything.
"""

from __future__ import annotations

import abc

import torch

from lamina.errors import ConfigError, failure_reason


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

    @abc.abstractmethod
    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        """A new wire tensor holding ``bucket``."""

    @abc.abstractmethod
    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """Write the reduced ``wire`` tensor into ``out`` (the bucket)."""


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


BUILTIN_CODECS: dict[str, Codec] = {
    "bf16": CastCodec("bf16", torch.bfloat16, 2.0**-8),
    "fp16": CastCodec("fp16", torch.float16, 2.0**-11),
}


def get_codec(spec: str | Codec | None) -> Codec | None:
    """The codec named ``spec`` (or ``spec`` itself); ConfigError listing names when unknown."""
    if spec is None or isinstance(spec, Codec):
        return spec
    try:
        return BUILTIN_CODECS[spec]
    except KeyError:
        raise ConfigError(
            f"codec {spec!r} is unknown; use one of {sorted(BUILTIN_CODECS)}, a Codec instance "
            "or None"
        ) from None


def self_check(codec: Codec, dtype: torch.dtype, device: torch.device) -> str:
    """Round-trip a probe bucket through ``codec``; '' when it works, else the reason."""
    probe = torch.linspace(-4.0, 4.0, 1031, dtype=torch.float32).to(dtype=dtype, device=device)
    try:
        wire = codec.encode(probe)
        if not isinstance(wire, torch.Tensor) or wire.numel() != probe.numel():
            return f"codec {codec.name} encoded a {probe.numel()}-element bucket wrongly"
        out = torch.empty_like(probe)
        codec.decode(wire, out)
    except Exception as exc:
        return f"codec {codec.name} failed its self-check: {failure_reason(exc)}"
    error = float(((out - probe).abs() / probe.abs().clamp(min=1e-3)).max())
    if not error <= codec.tolerance:
        return (
            f"codec {codec.name} round-trip error {error:.2e} exceeds its tolerance "
            f"{codec.tolerance:.2e}"
        )
    return ""
