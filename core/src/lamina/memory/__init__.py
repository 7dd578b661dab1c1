"""Layer 3, memory: ZeRO-3 shard layout of parameters in aligned, equal per-rank shards."""

from lamina.memory.layout import ParamShard, ShardLayout, UnitLayout, build_layout
from lamina.memory.units import ROOT_UNIT, group_units

__all__ = [
    "ROOT_UNIT",
    "ParamShard",
    "ShardLayout",
    "UnitLayout",
    "build_layout",
    "group_units",
]
