"""Gradient bucket planning from the captured graph, before step 1.

Parameters are grouped in gradient-ready order (the reverse of their first use in the
forward), one dtype per bucket, so that a bucket fills as backward reaches it and its
all-reduce can start while backward goes on. The first bucket is small, to start
communication early; the others are capped. Each parameter's slot starts on an aligned
element offset, and each bucket's length is padded to the alignment.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.units import format_bytes

MIB = 2**20


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketSlot:
    """Where one parameter's gradient lives inside its bucket (in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One flat gradient buffer and the collective that reduces it."""

    index: int
    dtype: str
    slots: tuple[BucketSlot, ...]
    numel: int
    element_size: int
    collective: str = "all_reduce"

    @property
    def nbytes(self) -> int:
        """Bytes of the (padded) flat buffer."""
        return self.numel * self.element_size

    @property
    def param_names(self) -> tuple[str, ...]:
        """Names of the parameters in this bucket, in slot order."""
        return tuple(s.name for s in self.slots)


@dataclass(frozen=True)
class BucketPlan:
    """The ordered buckets of a model, plus what was left out and why."""

    buckets: tuple[Bucket, ...]
    excluded: tuple[str, ...]
    cap_bytes: int
    first_bucket_bytes: int
    alignment_bytes: int
    notes: tuple[str, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        """Bytes moved by one step's collectives (padded buffers)."""
        return sum(b.nbytes for b in self.buckets)

    def to_json(self) -> dict[str, Any]:
        """The plan as plain data."""
        return {
            "buckets": [
                {**asdict(b), "nbytes": b.nbytes, "slots": [asdict(s) for s in b.slots]}
                for b in self.buckets
            ],
            "excluded": list(self.excluded),
            "cap_bytes": self.cap_bytes,
            "first_bucket_bytes": self.first_bucket_bytes,
            "alignment_bytes": self.alignment_bytes,
            "notes": list(self.notes),
        }

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON: equal plans on every rank have equal fingerprints."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def table(self) -> str:
        """A readable table: bucket, dtype, params, bytes, collective, first/last param."""
        rows = [("bucket", "dtype", "params", "bytes", "collective", "parameters")]
        for b in self.buckets:
            names = b.param_names
            span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
            rows.append(
                (str(b.index), b.dtype, str(len(names)), format_bytes(b.nbytes), b.collective, span)
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
            for r in rows
        ]
        lines.append(
            f"{len(self.buckets)} bucket(s), {format_bytes(self.total_bytes)} per step; "
            f"cap {format_bytes(self.cap_bytes)}, first {format_bytes(self.first_bucket_bytes)}, "
            f"alignment {self.alignment_bytes} B"
        )
        if self.excluded:
            lines.append(f"excluded (unused in the captured forward): {', '.join(self.excluded)}")
        return "\n".join(lines)


#: How many buckets the automatic cap aims for: enough that each bucket's all-reduce can
#: hide behind the backward of the layers before it, few enough to keep per-call overhead
#: small. Measured on gloo (benchmarks/dp_vs_ddp.py): per-layer buckets beat one 25 MiB one.
AUTO_TARGET_BUCKETS = 8
AUTO_MIN_CAP = 1 * MIB
AUTO_MAX_CAP = 25 * MIB


def auto_bucket_cap(params: Sequence[ParamSpec]) -> int:
    """A bucket cap for ``params``: their gradient bytes / 8, clamped to [1 MiB, 25 MiB]."""
    total = sum(p.numel * torch.empty((), dtype=p.dtype).element_size() for p in params)
    return int(min(AUTO_MAX_CAP, max(AUTO_MIN_CAP, total // AUTO_TARGET_BUCKETS)))


def _aligned(numel: int, align_elems: int) -> int:
    return -(-numel // align_elems) * align_elems


def plan_buckets(
    params: Sequence[ParamSpec],
    ready_order: Sequence[str],
    *,
    cap_bytes: int = 25 * MIB,
    first_bucket_bytes: int = 1 * MIB,
    alignment_bytes: int = 512,
    unused: Sequence[str] = (),
    strict: bool = False,
) -> BucketPlan:
    """Plan buckets for ``params`` in ``ready_order`` (names; gradient-ready order).

    Parameters named in ``unused`` are left out (``strict=True`` makes that an error).
    Parameters missing from ``ready_order`` but not unused go last, in ``params`` order.
    A dtype change closes the current bucket; so does reaching the cap (the first
    bucket's cap is ``first_bucket_bytes``). A parameter larger than the cap gets a
    bucket of its own.
    """
    if cap_bytes <= 0 or first_bucket_bytes <= 0:
        raise ConfigError(
            f"bucket caps must be > 0 bytes, got cap={cap_bytes}, first={first_bucket_bytes}"
        )
    if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
        raise ConfigError(f"alignment_bytes must be a power of two, got {alignment_bytes}")
    by_name = {p.name: p for p in params}
    unknown = [n for n in [*ready_order, *unused] if n not in by_name]
    if unknown:
        raise ConfigError(
            f"bucket plan names parameters the model does not have: {unknown[:5]}; "
            "capture the graph from this model"
        )
    if strict and unused:
        raise ConfigError(
            f"strict mode: parameters {list(unused)} are never used in the forward; remove "
            "them, freeze them (requires_grad=False), or pass strict=False to skip them"
        )
    skip = set(unused)
    order = [n for n in dict.fromkeys(ready_order) if n not in skip]
    order += [p.name for p in params if p.name not in skip and p.name not in set(order)]
    builder = _BucketBuilder(cap_bytes, first_bucket_bytes, alignment_bytes)
    for name in order:
        builder.add(by_name[name])
    notes = []
    if any(s not in ready_order for s in (p.name for p in params if p.name not in skip)):
        notes.append("some parameters had no graph position; they were placed last")
    return BucketPlan(
        tuple(builder.finish()),
        tuple(n for n in (p.name for p in params) if n in skip),
        cap_bytes,
        first_bucket_bytes,
        alignment_bytes,
        tuple(notes),
    )


class _BucketBuilder:
    def __init__(self, cap: int, first_cap: int, alignment: int) -> None:
        self.cap, self.first_cap, self.alignment = cap, first_cap, alignment
        self.buckets: list[Bucket] = []
        self.slots: list[BucketSlot] = []
        self.dtype: torch.dtype | None = None
        self.offset = 0

    def _limit(self) -> int:
        return self.first_cap if not self.buckets else self.cap

    def add(self, param: ParamSpec) -> None:
        size = torch.empty((), dtype=param.dtype).element_size()
        align = max(1, self.alignment // size)
        start = _aligned(self.offset, align)
        full = self.slots and (start + param.numel) * size > self._limit()
        if self.slots and (param.dtype != self.dtype or full):
            self._close()
            start = 0
        self.dtype = param.dtype
        self.slots.append(BucketSlot(param.name, param.shape, start, param.numel))
        self.offset = start + param.numel

    def _close(self) -> None:
        assert self.dtype is not None
        size = torch.empty((), dtype=self.dtype).element_size()
        numel = _aligned(self.offset, max(1, self.alignment // size))
        self.buckets.append(
            Bucket(len(self.buckets), dtype_name(self.dtype), tuple(self.slots), numel, size)
        )
        self.slots, self.offset = [], 0

    def finish(self) -> list[Bucket]:
        if self.slots:
            self._close()
        return self.buckets
