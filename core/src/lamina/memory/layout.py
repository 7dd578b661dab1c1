"""Shard layout: how each parameter is split by rows across ranks, and where the pieces live.

Every parameter is sharded along its first dim, as ``torch.distributed.tensor.Shard(0)``
splits it: with ``W`` ranks each rank holds ``rows = ceil(dim0 / W)`` rows (the last
ranks fewer, possibly none), so the user sees each parameter as a ``DTensor`` with its
original name and shape. A 0-dim parameter is replicated (every rank holds it). A unit
(parameters of one dtype gathered and freed together) keeps, per rank, one flat **shard
buffer**: each parameter's padded chunk (``rows`` rows) in order, then one used-flag slot
per parameter, padded to ``alignment_bytes``; the local shards are views of it, so the
optimizer updates the buffer in place and the all-gather sends it without a copy.

The all-gather of the shard buffers gives the **gathered** buffer, rank-major
(``[W, shard_numel]``); :meth:`UnitLayout.copy_out` copies it, one fused copy, into the
**unsharded** buffer where each parameter is contiguous (``W * rows`` rows, the first
``dim0`` of them real), and :meth:`UnitLayout.views` gives the parameters as views of
that. Gradients go the other way: :meth:`UnitLayout.scatter_input` lays the unsharded
gradient out rank-major for the reduce-scatter, with the used-flags in every rank's slot
so that every rank learns which parameters some rank used. The layout is plain data:
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

LAYOUT_VERSION = 2


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
    """One parameter of a unit: its row split and where its pieces live (elements).

    ``offset``: where its chunk starts in every rank's shard buffer. ``rows``: rows per
    rank (``ceil(dim0 / W)``; 1 for a 0-dim parameter, which every rank holds whole).
    ``full_offset``: where it starts in the unsharded buffer, which gives it
    ``W * chunk`` elements (its padded rows from every rank, in rank order).
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    rows: int
    full_offset: int

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    @property
    def replicated(self) -> bool:
        """A 0-dim parameter: not split, every rank holds it."""
        return len(self.shape) == 0

    @property
    def row_numel(self) -> int:
        """Elements of one row (one index of dim 0)."""
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def chunk(self) -> int:
        """Elements of one rank's padded chunk (``rows`` rows)."""
        return self.rows * self.row_numel

    def local_rows(self, rank: int) -> int:
        """Rows ``rank`` really holds (``Shard(0)``'s split: the last ranks fewer)."""
        if self.replicated:
            return 1
        return max(0, min(self.rows, self.shape[0] - rank * self.rows))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local shard."""
        return () if self.replicated else (self.local_rows(rank), *self.shape[1:])

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s local shard."""
        return self.local_rows(rank) * self.row_numel


@dataclass(frozen=True)
class UnitLayout:
    """One unit: its parameters' chunks in each rank's shard buffer, of one dtype."""

    index: int
    name: str
    dtype: str
    params: tuple[ParamShard, ...]
    world_size: int
    alignment_bytes: int
    element_size: int
    shard_numel: int

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        if dtype_from_name(self.dtype).itemsize != self.element_size:
            raise ConfigError(
                f"unit {self.name!r}: element_size {self.element_size} does not match "
                f"{self.dtype}; rebuild the layout"
            )
        check_alignment(self.alignment_bytes, self.element_size, f"{self.dtype} unit")
        align = self.alignment_bytes // self.element_size
        cursor = full = 0
        for p in self.params:
            rows = 1 if p.replicated else -(-p.shape[0] // self.world_size)
            if (p.offset, p.full_offset, p.rows) != (cursor, full, rows):
                raise ConfigError(
                    f"unit {self.name!r}: parameter {p.name!r} has a bad offset or row "
                    "split; rebuild the layout"
                )
            cursor += p.chunk
            full += self.world_size * p.chunk
        if self.shard_numel % align or self.shard_numel < cursor + len(self.params):
            raise ConfigError(
                f"unit {self.name!r}: shard_numel {self.shard_numel} does not hold its "
                "chunks and flags in whole alignment units; rebuild the layout"
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
        """Lay ``params`` ((name, shape) pairs, in order) out as one unit of ``dtype``."""
        check_world_size(world_size)
        size = dtype.itemsize
        check_alignment(alignment_bytes, size, f"{dtype_name(dtype)} unit {name!r}")
        shards: list[ParamShard] = []
        cursor = full = 0
        for pname, shape in params:
            shape = tuple(shape)
            rows = 1 if not shape else -(-shape[0] // world_size)
            shard = ParamShard(pname, shape, cursor, rows, full)
            shards.append(shard)
            cursor += shard.chunk
            full += world_size * shard.chunk
        total = _round_up(cursor + len(shards), alignment_bytes // size)
        return cls(
            index, name, dtype_name(dtype), tuple(shards), world_size, alignment_bytes, size, total
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The unit's dtype as a ``torch.dtype``."""
        return dtype_from_name(self.dtype)

    @property
    def total_numel(self) -> int:
        """Elements of the gathered buffer (every rank's shard buffer, rank-major)."""
        return self.world_size * self.shard_numel

    @property
    def unsharded_numel(self) -> int:
        """Elements of the unsharded buffer (each parameter's padded rows, contiguous)."""
        return self.world_size * self.flag_offset

    @property
    def flag_region(self) -> tuple[int, int]:
        """Where the used-flags sit in each slot (and shard gradient): ``(start, stop)``.
        They are counts a codec must deliver exactly, apart from its blocks."""
        return self.flag_offset, self.flag_offset + len(self.params)

    @property
    def flag_offset(self) -> int:
        """Where the used-flags start in a shard buffer (after the last chunk)."""
        return sum(p.chunk for p in self.params)

    @property
    def shard_bytes(self) -> int:
        """Bytes in each rank's shard buffer."""
        return self.shard_numel * self.element_size

    @property
    def param_numel(self) -> int:
        """Elements of the unit's parameters (Psi of the unit)."""
        return sum(p.numel for p in self.params)

    @property
    def padding(self) -> int:
        """Elements of the gathered buffer that hold no parameter (row padding, flags,
        alignment)."""
        return self.total_numel - self.param_numel

    @property
    def param_names(self) -> tuple[str, ...]:
        """Names of the unit's parameters, in buffer order."""
        return tuple(p.name for p in self.params)

    def _check(self, flat: torch.Tensor, numel: int, what: str) -> None:
        if flat.dim() != 1 or flat.numel() != numel:
            raise ConfigError(
                f"unit {self.name!r}: {what} must be a 1-D tensor of {numel} elements, got "
                f"{tuple(flat.shape)}"
            )

    def shard_of(
        self, tensors: Mapping[str, torch.Tensor], rank: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``rank``'s shard buffer of the full parameters ``tensors`` (name -> tensor):
        its rows of each, zero elsewhere; values copied (cast to the unit's dtype), no
        autograd. ``out`` (1-D, ``shard_numel``) is filled in place if given."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside world size {self.world_size}")
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
            out = torch.zeros(self.shard_numel, dtype=self.torch_dtype, device=device)
        else:
            self._check(out, self.shard_numel, "out")
            out.zero_()
        with torch.no_grad():
            for p in self.params:
                source = tensors[p.name].reshape(-1)
                start = 0 if p.replicated else rank * p.rows * p.row_numel
                n = p.local_numel(rank)
                out[p.offset : p.offset + n].copy_(source[start : start + n])
        return out

    def local_views(self, shard: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """``rank``'s local shards as views of its shard buffer (shape ``local_shape``)."""
        self._check(shard, self.shard_numel, "the shard buffer")
        return {
            p.name: shard[p.offset : p.offset + p.local_numel(rank)].view(p.local_shape(rank))
            for p in self.params
        }

    def copy_out(self, gathered: torch.Tensor, unsharded: torch.Tensor) -> torch.Tensor:
        """Fill ``unsharded`` from ``gathered`` (rank-major) in one fused copy: each
        parameter's rows from every rank, contiguous. Returns ``unsharded``."""
        self._check(gathered, self.total_numel, "the gathered buffer")
        self._check(unsharded, self.unsharded_numel, "the unsharded buffer")
        if not self.params:
            return unsharded
        w = self.world_size
        sizes = [p.chunk for p in self.params] + [self.shard_numel - self.flag_offset]
        outs = [
            unsharded[p.full_offset : p.full_offset + w * p.chunk].view(w, p.chunk)
            for p in self.params
        ]
        tail = torch.empty(w, sizes[-1], dtype=gathered.dtype, device=gathered.device)
        torch.split_with_sizes_copy(
            gathered.view(w, self.shard_numel), sizes, dim=1, out=[*outs, tail]
        )
        return unsharded

    def views(self, unsharded: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters (their original shapes) as views of the unsharded buffer."""
        self._check(unsharded, self.unsharded_numel, "the unsharded buffer")
        return {
            p.name: unsharded[p.full_offset : p.full_offset + p.numel].view(p.shape)
            for p in self.params
        }

    def scatter_input(self, grad: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter input (rank-major, ``total_numel``) of the unsharded
        gradient ``grad``: rank ``r``'s slot holds row chunk ``r`` of every parameter and
        the used-``flags`` (one per parameter), so that every rank receives the sum of
        the flags. A replicated parameter's gradient goes to every slot."""
        self._check(grad, self.unsharded_numel, "the unsharded gradient")
        w = self.world_size
        pieces = []
        for p in self.params:
            block = grad[p.full_offset : p.full_offset + w * p.chunk].view(w, p.chunk)
            if p.replicated:
                block = block[:1].expand(w, 1)
            pieces.append(block)
        pad = self.shard_numel - self.flag_offset - len(self.params)
        pieces.append(flags.to(grad.dtype).view(1, -1).expand(w, len(self.params)))
        pieces.append(grad.new_zeros(w, pad))
        return torch.cat(pieces, dim=1).view(-1)

    def place_shard(self, shard: torch.Tensor, out: torch.Tensor, rank: int) -> torch.Tensor:
        """Fill ``out`` (1-D, ``total_numel``) with ``rank``'s shard buffer ``shard`` laid
        out as the unsharded buffer (``out[:unsharded_numel]``): its row chunk of every
        parameter where the unsharded buffer keeps it, zeros elsewhere (the flags and the
        tail included). Summed over the ranks (an all-reduce), ``out`` *is* the unsharded
        buffer: no gathered buffer and no :meth:`copy_out`. Returns ``out``."""
        self._check(shard, self.shard_numel, "the shard buffer")
        self._check(out, self.total_numel, "the all-reduce buffer")
        out.zero_()
        if self.params:
            torch.split_with_sizes_copy(
                shard.narrow(0, 0, self.flag_offset),
                [p.chunk for p in self.params],
                out=[out.narrow(0, p.full_offset + rank * p.chunk, p.chunk) for p in self.params],
            )
        return out

    def scatter_input_of(
        self,
        grads: Sequence[torch.Tensor | None],
        flags: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`scatter_input` from the parameters' own gradients (``grads``, in
        parameter order, of their shapes; None: the parameter got none, zeros) in one
        fused copy, without an unsharded gradient: rank ``r``'s slot holds row chunk
        ``r`` of every gradient and the used-``flags``. Written into ``out`` (1-D,
        ``total_numel``, its dtype: gradients are cast on the way) or a new tensor of
        ``flags``' dtype."""
        if len(grads) != len(self.params):
            raise ConfigError(
                f"unit {self.name!r}: {len(grads)} gradients for {len(self.params)} parameters"
            )
        if out is None:
            out = torch.empty(self.total_numel, dtype=flags.dtype, device=flags.device)
        self._check(out, self.total_numel, "the reduce-scatter input")
        w = self.world_size
        zero = out.new_zeros(())
        pieces: list[torch.Tensor] = []
        for p, g in zip(self.params, grads, strict=True):
            if g is None:
                pieces.append(zero.expand(w, p.chunk))
            elif p.replicated:
                pieces.append(g.reshape(1, 1).expand(w, 1))
            elif p.numel == w * p.chunk:
                pieces.append(g.reshape(w, p.chunk))
            else:  # the last ranks' padding rows: zeros
                padded = g.new_zeros(w * p.chunk)
                padded[: p.numel].copy_(g.reshape(-1))
                pieces.append(padded.view(w, p.chunk))
        pieces.append(flags.view(1, -1).expand(w, len(self.params)))
        pieces.append(zero.expand(w, self.shard_numel - self.flag_offset - len(self.params)))
        torch.cat(pieces, dim=1, out=out.view(w, self.shard_numel))
        return out

    def to_json(self) -> dict[str, Any]:
        """The unit as plain data (derived sizes included for readers)."""
        return {
            "index": self.index,
            "name": self.name,
            "dtype": self.dtype,
            "world_size": self.world_size,
            "alignment_bytes": self.alignment_bytes,
            "element_size": self.element_size,
            "shard_numel": self.shard_numel,
            "padding": self.padding,
            "params": [
                {
                    "name": p.name,
                    "shape": list(p.shape),
                    "offset": p.offset,
                    "rows": p.rows,
                    "full_offset": p.full_offset,
                }
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
                int(p["rows"]),
                int(p["full_offset"]),
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
            int(data["shard_numel"]),
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
        """A readable table: unit, dtype, params, gathered, shard, padding (elements)."""
        rows: list[tuple[str, ...]] = [("unit", "dtype", "params", "gathered", "shard", "padding")]
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
