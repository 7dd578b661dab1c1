"""The options ``lamina.distribute(model, "dp", ...)`` accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.comm.codecs import CODEC_SCOPES, Codec
from lamina.comm.cost import ALGORITHM_OPTIONS
from lamina.errors import ConfigError
from lamina.graph import CAPTURE_METHODS
from lamina.strategies.codec_registry import resolve_codec
from lamina.strategies.contract import StrategyOptions
from lamina.strategies.dp.compiled import compile_backend_of


@dataclass(frozen=True)
class DataParallelOptions(StrategyOptions):
    """Data-parallel options, validated on construction.

    ``example_inputs`` / ``example_kwargs`` capture the graph at wrap time (else on the
    first forward). ``bucket_cap_mb=None`` sizes buckets automatically from an alpha-beta
    cost of the group's all-reduce (:mod:`lamina.comm.buckets`: latency-bound tensors
    ride with a neighbour, the rest in about 8 buckets so that communication overlaps
    backward); a number fixes the cap. ``first_bucket_mb=None`` is DDP's 1 MiB first
    bucket, which still takes the latency floor; a number fixes it. ``codec``
    (``"bf16"``, ``"fp16"``, ``"fp8"`` or a :class:`~lamina.comm.codecs.Codec` such as
    ``Fp8Codec(error_feedback=False)``) compresses fp32 buckets on the wire; fp8 sums in
    two phases with error feedback, over the whole group (``codec_scope="all"``) or
    only in the hierarchical algorithm's inter-host phase (``"inter"``: the reductions
    inside a host stay exact); ``compile`` (``True`` or a ``torch.compile`` backend name) runs
    the forward compiled;
    ``capture_methods`` limits the graph capture paths; ``strict`` refuses parameters the
    captured forward does not use. ``algorithm`` is the all-reduce algorithm of every
    bucket (``"auto"``: the cost model's pick per bucket from the topology, see
    :mod:`lamina.comm.cost`; or ``"flat"``, ``"ordered"``, ``"hierarchical"``,
    ``"pipelined"``).
    """

    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: dict[str, Any] | None = None
    bucket_cap_mb: float | None = None
    first_bucket_mb: float | None = None
    alignment_bytes: int = 512
    broadcast_buffers: bool = True
    strict: bool = False
    codec: str | Codec | None = None
    compile: bool | str = False
    capture_methods: tuple[str, ...] = CAPTURE_METHODS
    algorithm: str = "auto"
    codec_scope: str = "all"

    def __post_init__(self) -> None:
        cap, first = self.bucket_cap_mb, self.first_bucket_mb
        if (cap is not None and not cap > 0) or (first is not None and not first > 0):
            raise ConfigError(
                f"bucket_cap_mb and first_bucket_mb must be > 0, got {cap} and {first}"
            )
        if isinstance(self.alignment_bytes, bool) or not (
            isinstance(self.alignment_bytes, int) and self.alignment_bytes > 0
        ):
            raise ConfigError(
                f"alignment_bytes must be a positive int, got {self.alignment_bytes!r}"
            )
        if self.example_inputs is not None and not isinstance(self.example_inputs, tuple):
            raise ConfigError(
                f"example_inputs must be a tuple, got {type(self.example_inputs).__name__}; "
                "pass a single input as (x,)"
            )
        if self.algorithm not in ALGORITHM_OPTIONS:
            raise ConfigError(
                f"algorithm={self.algorithm!r} is not one of {list(ALGORITHM_OPTIONS)}"
            )
        codec = resolve_codec(self.codec)  # a ConfigError naming an unknown codec
        if self.codec_scope not in CODEC_SCOPES:
            raise ConfigError(
                f"codec_scope={self.codec_scope!r} is not one of {list(CODEC_SCOPES)}"
            )
        if self.codec_scope == "inter" and (codec is None or not codec.two_phase):
            raise ConfigError(
                "codec_scope='inter' compresses the inter-host phase of a two-phase codec; "
                "pass codec='fp8'"
            )
        if self.codec_scope == "inter" and self.algorithm in ("flat", "ordered"):
            raise ConfigError(
                f"codec_scope='inter' needs an inter-host phase, which algorithm="
                f"{self.algorithm!r} has not; use algorithm='auto', 'hierarchical' or "
                "'pipelined'"
            )
        compile_backend_of(self.compile)  # a ConfigError for a bad compile= value
