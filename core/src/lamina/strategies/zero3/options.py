"""The options ``lamina.distribute(model, "zero3" | "hsdp", ...)`` accepts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.comm.codecs import Codec
from lamina.comm.cost import SHARDED_OPTIONS
from lamina.errors import ConfigError
from lamina.runtime.primitives import PRIMITIVE_MODES, REPLACEABLE
from lamina.strategies.contract import StrategyOptions
from lamina.strategies.zero3.unit_codec import sharded_codec


@dataclass(frozen=True)
class Zero3Options(StrategyOptions):
    """Sharded data-parallel options, validated on construction.

    Units come from the module structure: one per block of the first block container
    (an ``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict`` or custom container of
    blocks, :func:`lamina.graph.blocks.unit_blocks`), blocks smaller than
    ``min_unit_numel`` elements merged, the rest the root unit. ``param_dtype`` (e.g.
    ``torch.bfloat16``) turns on mixed precision: shards and the optimizer stay in their
    dtype (fp32 master weights), units are gathered and computed in ``param_dtype``,
    gradients reduced in the shard's dtype.
    ``reshard_after_forward=False`` keeps each unit gathered from its forward to its
    backward (with True, only the last unit and the whole-forward ones are). ``collectives``
    picks the gather / reduce-scatter primitives: ``"native"``, ``"all_reduce"`` (their
    all-reduce forms) or ``"auto"`` (native, except on gloo: one broadcast per rank and
    an all_to_all, faster there; all-reduce forms beyond 8 ranks);
    ``disable_collectives`` (or ``$LAMINA_DISABLE_COLLECTIVES``) forces the all-reduce
    form for the ops named. ``algorithm`` is how each unit's gathers and reduce-scatter
    cross the hosts: ``"flat"`` (the primitives above on the shard group),
    ``"hierarchical"`` (inside each host, then across hosts: only ``1/L`` of the buffer
    leaves a host of ``L`` ranks) or ``"auto"`` (the cost model's pick per unit, from
    the topology's links; flat on one host). ``codec="fp8"`` (or an
    :class:`~lamina.comm.codecs.Fp8Codec`) sends gradients in e4m3 with error feedback:
    ZeRO-3's reduce-scatter (then over the flat shard group), HSDP's all-reduce across
    the replicas (the slow links; the reduce-scatter inside a domain stays exact).
    """

    alignment_bytes: int = 512
    min_unit_numel: int = 1 << 16
    param_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    collectives: str = "auto"
    disable_collectives: tuple[str, ...] = ()
    algorithm: str = "auto"
    codec: str | Codec | None = None

    def __post_init__(self) -> None:
        for name in ("alignment_bytes", "min_unit_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if self.alignment_bytes == 0:
            raise ConfigError("alignment_bytes must be > 0, e.g. 512")
        dtype = self.param_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(
                f"param_dtype must be a floating torch dtype such as torch.bfloat16, got {dtype!r}"
            )
        if self.collectives not in PRIMITIVE_MODES:
            raise ConfigError(
                f"collectives={self.collectives!r} is not one of {list(PRIMITIVE_MODES)}"
            )
        unknown = [op for op in self.disable_collectives if op not in REPLACEABLE]
        if isinstance(self.disable_collectives, str) or unknown:
            raise ConfigError(
                f"disable_collectives={self.disable_collectives!r}: give a tuple of "
                f"{list(REPLACEABLE)}"
            )
        if self.algorithm not in SHARDED_OPTIONS:
            raise ConfigError(f"algorithm={self.algorithm!r} is not one of {list(SHARDED_OPTIONS)}")
        sharded_codec(self.codec)  # a ConfigError for a codec the sharded strategies lack
