"""Shard layout: where every parameter lives in its unit's flat buffer and in each shard.

Each unit holds parameters of one dtype, packed in order into one flat buffer. Every
parameter with elements starts on an ``alignment_bytes`` boundary (zero-element
parameters take no space and need no alignment); the gaps are zero. The buffer is then
padded with zeros so that it splits into ``world_size`` equal shards, each a whole
number of ``alignment_bytes``: rank ``r`` holds elements
``[r * shard_numel, (r + 1) * shard_numel)``, so concatenating the shards of all ranks
(what an all-gather produces) gives the full buffer back. The layout is plain data:
JSON round trip, fingerprint, readable table. :func:`build_layout` builds one from a model.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from lamina.dtypes import dtype_from_name, dtype_name
from lamina.errors import ConfigError
from lamina.memory.units import check_units, group_units

LAYOUT_VERSION = 1


def check_world_size(world_size: int) -> None:
    """Raise ConfigError unless ``world_size`` is an integer >= 1."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")


def check_alignment(alignment_bytes: int, element_size: int, what: str) -> None:
    """Raise ConfigError unless ``alignment_bytes`` is a power of two >= ``element_size``."""
    if (
        not isinstance(alignment_bytes, int)
        or alignment_bytes < 1
        or alignment_bytes & (alignment_bytes - 1)
    ):
        raise ConfigError(f"alignment_bytes must be a power of two, got {alignment_bytes!r}")
    if alignment_bytes < element_size:
        raise ConfigError(
            f"alignment_bytes={alignment_bytes} is smaller than the {element_size}-byte "
            f"elements of {what}; use at least {element_size}"
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ParamShard:
    """Where one parameter lives in its unit's full (unsharded) flat buffer, in elements."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        """One past the parameter's last element."""
        return self.offset + self.numel


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that lies in one rank's shard (element counts)."""

    name: str
    param_start: int  # first element, in the parameter's flattened order
    shard_start: int  # where it sits in the rank's shard
    numel: int


@dataclass(frozen=True)
class UnitLayout:
    """One unit: its parameters' places in one flat buffer of one dtype, and the shards."""

    index: int
    name: str
    dtype: str
    params: tuple[ParamShard, ...]
    world_size: int
    alignment_bytes: int
    element_size: int
    total_numel: int

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        if dtype_from_name(self.dtype).itemsize != self.element_size:
            raise ConfigError(
                f"unit {self.name!r}: element_size {self.element_size} does not match "
                f"{self.dtype}; rebuild the layout"
            )
        check_alignment(self.alignment_bytes, self.element_size, f"{self.dtype} unit")
        align = self.alignment_bytes // self.element_size
        if self.total_numel < 0 or self.total_numel % (self.world_size * align):
            raise ConfigError(
                f"unit {self.name!r}: total_numel {self.total_numel} does not split into "
                f"{self.world_size} aligned shards; rebuild the layout"
            )
        cursor = 0
        for p in self.params:
            aligned = p.numel == 0 or p.offset % align == 0
            if p.numel != math.prod(p.shape) or p.offset < cursor or not aligned:
                raise ConfigError(
                    f"unit {self.name!r}: parameter {p.name!r} has a bad offset or size; "
                    "rebuild the layout"
                )
            cursor = p.end
        if cursor > self.total_numel:
            raise ConfigError(
                f"unit {self.name!r}: parameters end past total_numel; rebuild the layout"
            )

    @classmethod
    def pack(
        cls,
        index: int,
        name: str,
        dtype: torch.dtype,
        params: Sequence[tuple[str, tuple[int, ...]]],
        world_size: int,
        alignment_bytes: int = 512,
    ) -> UnitLayout:
        """Pack ``params`` ((name, shape) pairs, in order) into one unit of ``dtype``."""
        check_world_size(world_size)
        size = dtype.itemsize
        check_alignment(alignment_bytes, size, f"{dtype_name(dtype)} unit {name!r}")
        align = alignment_bytes // size
        shards: list[ParamShard] = []
        cursor = 0
        for pname, shape in params:
            numel = math.prod(shape)
            offset = cursor if numel == 0 else _round_up(cursor, align)
            shards.append(ParamShard(pname, tuple(shape), offset, numel))
            cursor = offset + numel
        total = _round_up(cursor, world_size * align)
        return cls(
            index, name, dtype_name(dtype), tuple(shards), world_size, alignment_bytes, size, total
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The unit's dtype as a ``torch.dtype``."""
        return dtype_from_name(self.dtype)

    @property
    def shard_numel(self) -> int:
        """Elements in each rank's shard."""
        return self.total_numel // self.world_size

    @property
    def shard_bytes(self) -> int:
        """Bytes in each rank's shard."""
        return self.shard_numel * self.element_size

    @property
    def used_numel(self) -> int:
        """End of the last parameter: the elements before the trailing padding."""
        return max((p.end for p in self.params), default=0)

    @property
    def padding(self) -> int:
        """Trailing zero elements after the last parameter (gaps between parameters,
        from aligning each parameter's start, are zero too but not counted here)."""
        return self.total_numel - self.used_numel

    @property
    def param_names(self) -> tuple[str, ...]:
        """Names of the unit's parameters, in buffer order."""
        return tuple(p.name for p in self.params)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` element range of ``rank``'s shard in the full buffer."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside world size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> tuple[ShardPiece, ...]:
        """The parts of parameters that lie in ``rank``'s shard, in buffer order."""
        start, end = self.shard_range(rank)
        found = []
        for p in self.params:
            lo, hi = max(p.offset, start), min(p.end, end)
            if lo < hi:
                found.append(ShardPiece(p.name, lo - p.offset, lo - start, hi - lo))
        return tuple(found)

    def _gaps(self) -> list[tuple[int, int]]:
        gaps, cursor = [], 0
        for p in self.params:
            if p.offset > cursor:
                gaps.append((cursor, p.offset))
            cursor = max(cursor, p.end)
        if cursor < self.total_numel:
            gaps.append((cursor, self.total_numel))
        return gaps

    def _check_flat(self, flat: torch.Tensor, what: str) -> None:
        if flat.dim() != 1 or flat.numel() != self.total_numel or flat.dtype != self.torch_dtype:
            raise ConfigError(
                f"unit {self.name!r}: {what} must be a 1-D {self.dtype} tensor of "
                f"{self.total_numel} elements, got {flat.dtype} {tuple(flat.shape)}"
            )

    def flatten(
        self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The full padded flat buffer of ``tensors`` (name -> tensor, the unit's params).

        Gaps and padding are zero; values are copied (cast to the unit's dtype if
        needed), without autograd. ``out`` (1-D, ``total_numel``, unit dtype) is filled
        in place; otherwise a buffer is allocated on the first parameter's device.
        """
        missing = [p.name for p in self.params if p.name not in tensors]
        if missing:
            raise ConfigError(
                f"unit {self.name!r}: no tensor given for parameters {missing[:5]}; "
                "pass every parameter of the unit"
            )
        for p in self.params:
            if tuple(tensors[p.name].shape) != p.shape:
                raise ConfigError(
                    f"unit {self.name!r}: parameter {p.name!r} has shape "
                    f"{tuple(tensors[p.name].shape)}, the layout says {p.shape}; rebuild it"
                )
        if out is None:
            device = tensors[self.params[0].name].device if self.params else None
            out = torch.empty(self.total_numel, dtype=self.torch_dtype, device=device)
        else:
            self._check_flat(out, "out")
        with torch.no_grad():
            for start, end in self._gaps():
                out[start:end].zero_()
            for p in self.params:
                out[p.offset : p.end].view(p.shape).copy_(tensors[p.name])
        return out

    def shard_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """A view of ``rank``'s shard of the full buffer ``flat``."""
        self._check_flat(flat, "the flat buffer")
        start, end = self.shard_range(rank)
        return flat[start:end]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the full buffer ``flat`` with the parameters' shapes."""
        self._check_flat(flat, "the flat buffer")
        return {p.name: flat[p.offset : p.end].view(p.shape) for p in self.params}

    def to_json(self) -> dict[str, Any]:
        """The unit as plain data (derived sizes included for readers)."""
        return {
            "index": self.index,
            "name": self.name,
            "dtype": self.dtype,
            "world_size": self.world_size,
            "alignment_bytes": self.alignment_bytes,
            "element_size": self.element_size,
            "total_numel": self.total_numel,
            "shard_numel": self.shard_numel,
            "padding": self.padding,
            "params": [
                {"name": p.name, "shape": list(p.shape), "offset": p.offset, "numel": p.numel}
                for p in self.params
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UnitLayout:
        """The unit from :meth:`to_json` output (validated)."""
        params = tuple(
            ParamShard(
                str(p["name"]),
                tuple(int(s) for s in p["shape"]),
                int(p["offset"]),
                int(p["numel"]),
            )
            for p in data["params"]
        )
        return cls(
            int(data["index"]),
            str(data["name"]),
            str(data["dtype"]),
            params,
            int(data["world_size"]),
            int(data["alignment_bytes"]),
            int(data["element_size"]),
            int(data["total_numel"]),
        )


@dataclass(frozen=True)
class ShardLayout:
    """Every unit of a model for one world size: the explicit, serializable shard metadata."""

    units: tuple[UnitLayout, ...]
    world_size: int
    alignment_bytes: int

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        seen: dict[str, str] = {}
        for i, unit in enumerate(self.units):
            if unit.index != i:
                raise ConfigError(f"unit {unit.name!r} has index {unit.index}, expected {i}")
            if (unit.world_size, unit.alignment_bytes) != (self.world_size, self.alignment_bytes):
                raise ConfigError(
                    f"unit {unit.name!r} was laid out for world size {unit.world_size} and "
                    f"alignment {unit.alignment_bytes}, the layout for {self.world_size} and "
                    f"{self.alignment_bytes}; rebuild it"
                )
            for name in unit.param_names:
                if name in seen:
                    raise ConfigError(
                        f"parameter {name!r} is in two units ({seen[name]!r} and "
                        f"{unit.name!r}); put each parameter in one unit"
                    )
                seen[name] = unit.name
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ConfigError(f"unit names must be unique, got {names}")

    @cached_property
    def _by_param(self) -> dict[str, UnitLayout]:
        return {name: unit for unit in self.units for name in unit.param_names}

    def unit_of(self, name: str) -> UnitLayout:
        """The unit holding parameter ``name``."""
        try:
            return self._by_param[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is in no unit of this shard layout") from None

    @property
    def param_names(self) -> tuple[str, ...]:
        """Every parameter in the layout, unit by unit."""
        return tuple(n for u in self.units for n in u.param_names)

    def bytes_per_rank(self) -> int:
        """Bytes of parameter shards each rank holds (padding included)."""
        return sum(u.shard_bytes for u in self.units)

    def to_json(self) -> dict[str, Any]:
        """The layout as plain data."""
        return {
            "version": LAYOUT_VERSION,
            "world_size": self.world_size,
            "alignment_bytes": self.alignment_bytes,
            "units": [u.to_json() for u in self.units],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardLayout:
        """The layout from :meth:`to_json` output; inconsistent data raises ConfigError."""
        if data.get("version") != LAYOUT_VERSION:
            raise ConfigError(
                f"shard layout version {data.get('version')!r} is not {LAYOUT_VERSION}; "
                "rebuild the layout with this lamina"
            )
        try:
            units = tuple(UnitLayout.from_json(u) for u in data["units"])
            return cls(units, int(data["world_size"]), int(data["alignment_bytes"]))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"shard layout JSON is malformed ({exc!r}); rebuild it") from None

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON: equal layouts have equal fingerprints."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def table(self) -> str:
        """A readable table: unit, dtype, params, total, shard, padding (elements)."""
        rows: list[tuple[str, ...]] = [("unit", "dtype", "params", "total", "shard", "padding")]
        for u in self.units:
            sizes = (len(u.params), u.total_numel, u.shard_numel, u.padding)
            rows.append((u.name, u.dtype, *(str(n) for n in sizes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.append(
            f"{len(self.units)} unit(s), world size {self.world_size}, alignment "
            f"{self.alignment_bytes} B, {self.bytes_per_rank()} parameter bytes per rank"
        )
        return "\n".join(line.rstrip() for line in lines)


def build_layout(
    model: nn.Module,
    world_size: int,
    *,
    alignment_bytes: int = 512,
    units: Sequence[tuple[str, Sequence[str]]] | None = None,
) -> ShardLayout:
    """The shard layout of ``model``'s parameters for ``world_size`` ranks.

    ``units`` ((unit name, [param names]) in order) defaults to :func:`group_units`;
    parameters no unit names are not in the layout, and empty units are skipped. A
    unit with parameters of several dtypes is split into one unit per dtype, in order
    of first appearance, named ``"name[dtype]"`` (e.g. ``"blocks.0[bfloat16]"``).
    """
    check_world_size(world_size)
    check_alignment(alignment_bytes, 1, "any dtype")
    groups = group_units(model) if units is None else check_units(model, units)
    params = dict(model.named_parameters())
    built: list[UnitLayout] = []
    for unit_name, names in groups:
        by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
        for n in names:
            by_dtype.setdefault(params[n].dtype, []).append((n, tuple(params[n].shape)))
        for dtype, members in by_dtype.items():
            name = f"{unit_name}[{dtype_name(dtype)}]" if len(by_dtype) > 1 else unit_name
            built.append(
                UnitLayout.pack(len(built), name, dtype, members, world_size, alignment_bytes)
            )
    return ShardLayout(tuple(built), world_size, alignment_bytes)
