"""Gradient bucket planning from the captured graph, before step 1.

Parameters are grouped in gradient-ready order (the reverse of their first use in the
forward), one dtype per bucket, so that a bucket fills as backward reaches it and its
all-reduce can start while backward goes on. Each parameter's slot starts on an aligned
element offset, and each bucket's length is padded to the alignment.

Where the boundaries go: an alpha-beta cost model
-------------------------------------------------
A collective of ``n`` bytes costs about ``alpha + n * beta``: a fixed latency ``alpha``
(launch, handshakes, wake-ups, one per collective whatever its size) plus ``beta`` seconds
per byte. Below the *knee* ``alpha / beta`` a collective is latency-bound: eight 2 KiB
buckets cost eight alphas and move almost nothing. The rule:

1. **Latency floor.** A bucket stays open (takes the next parameter even past its cap)
   while it holds fewer than ``floor`` bytes, with
   ``floor = (1 / LATENCY_FRACTION - 1) * alpha / beta``: at ``n = floor`` the latency
   is ``LATENCY_FRACTION`` (1/4) of the bucket's time, ``alpha / (alpha + n beta)``, so no
   closed bucket spends more than a quarter of its time on latency. The floor never
   exceeds half the cap (an explicit small cap still splits: every bucket but the last
   then holds at least half of it). Small tensors (biases, norms) therefore
   always ride with a neighbour; only the last bucket may be smaller than the floor.
2. **Cap.** A bucket at or above its floor closes before the parameter that would take
   it past its cap; a parameter larger than the cap gets a bucket of its own (split
   only at parameter boundaries). The automatic cap (:func:`auto_bucket_cap`) is the
   gradient bytes / ``AUTO_TARGET_BUCKETS`` -- enough buckets that each all-reduce can
   hide behind the backward of the layers before it -- clamped to
   ``[max(1 MiB, 2 floor), max(25 MiB, 2 floor)]``: never so small that the floor cannot
   act, so a small model gets a handful of buckets (the 4 x Linear(512, 512) MLP, 4 MiB
   of fp32 gradients: 2, as torch DDP), a large one many (a 1 GiB model: about 40).
3. **First bucket.** Its cap is ``min(first_bucket_bytes, cap)`` (1 MiB by default, as in
   DDP), so communication starts as soon as the last layers' gradients are ready; with
   the default it first takes the floor like every bucket (at most half the general
   cap), since a first all-reduce that is mostly latency costs more than its overlap
   with backward saves: the 4 x Linear(512, 512) MLP gets two 2 MiB buckets on 2 gloo
   ranks and one on 4, measured faster than DDP's 1 + 3 MiB. A given
   ``first_bucket_bytes`` keeps its meaning: its floor is at most half of it.

The default ``alpha`` / ``beta`` are measured for gloo all-reduce between 2 ranks on one
host (see :data:`GLOO_ALPHA_S`) and scaled to the group's size as a ring scales them
(:func:`ring_all_reduce_cost`); a caller with a cost model of its real group passes its
own, and a slower-to-start group (more ranks, a network hop) gets larger buckets.
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
#: small. The latency floor (below) raises the cap of small models above total / 8.
AUTO_TARGET_BUCKETS = 8
AUTO_MIN_CAP = 1 * MIB
#: The first bucket's cap unless one is given (DDP's).
DEFAULT_FIRST_BUCKET = 1 * MIB
AUTO_MAX_CAP = 25 * MIB

#: Per-collective latency of gloo all-reduce, 2 ranks on one host (loopback TCP), fp32.
#: Measured on the project's 2-core CI box (torch 2.13 CPU, one thread per rank): each
#: size from 1 KiB to 16 MiB (powers of two) all-reduced 30 times (10 above 1 MiB) after
#: 3 warm-ups, each timed between ``dist.barrier()``s; median per size, median of 3
#: passes; then a least-squares fit of ``t = alpha + n beta`` weighted by 1 / t (relative
#: error). Three runs gave alpha 0.40-0.45 ms and beta 0.64-0.70 ns/B (1.4-1.6 GB/s):
#: 1 KiB-16 KiB all take ~0.4 ms, 1 MiB ~0.8-1.1 ms, 4 MiB ~3-3.8 ms, 16 MiB ~11.5-13.4 ms.
#: The knee alpha / beta is ~620 KB. (4 ranks on the same 2 cores, oversubscribed:
#: alpha ~5.8 ms, beta ~1.0 ns/B, knee ~5.6 MB.)
GLOO_ALPHA_S = 4.0e-4
#: Seconds per byte of gloo all-reduce, 2 ranks on one host; see :data:`GLOO_ALPHA_S`.
GLOO_BETA_S_PER_BYTE = 6.5e-10
#: The largest share of a (non-last) bucket's collective time the latency may take.
LATENCY_FRACTION = 0.25


def ring_all_reduce_cost(
    ranks: int,
    alpha_s: float = GLOO_ALPHA_S,
    beta_s_per_byte: float = GLOO_BETA_S_PER_BYTE,
) -> tuple[float, float]:
    """(alpha, beta) of a ring all-reduce over ``ranks`` from figures measured on 2
    ranks: the ring takes ``2(P-1)`` steps, each paying one hop's latency (2 steps at
    P=2), and pushes ``2(P-1)/P`` of the buffer through each rank's link (1 at P=2)."""
    if ranks < 2:
        return alpha_s, beta_s_per_byte
    return alpha_s * (ranks - 1), beta_s_per_byte * 2 * (ranks - 1) / ranks


def latency_floor_bytes(
    alpha_s: float = GLOO_ALPHA_S, beta_s_per_byte: float = GLOO_BETA_S_PER_BYTE
) -> int:
    """The smallest bucket whose latency is at most :data:`LATENCY_FRACTION` of its time:
    ``(1 / LATENCY_FRACTION - 1) * alpha / beta`` bytes (3 x the knee)."""
    if alpha_s < 0 or beta_s_per_byte <= 0:
        raise ConfigError(
            f"need alpha_s >= 0 and beta_s_per_byte > 0, got {alpha_s} and {beta_s_per_byte}"
        )
    return int((1 / LATENCY_FRACTION - 1) * alpha_s / beta_s_per_byte)


def auto_bucket_cap(
    params: Sequence[ParamSpec],
    *,
    alpha_s: float = GLOO_ALPHA_S,
    beta_s_per_byte: float = GLOO_BETA_S_PER_BYTE,
) -> int:
    """A bucket cap for ``params``: their gradient bytes / 8, clamped to
    ``[max(1 MiB, 2 floor), max(25 MiB, 2 floor)]`` with ``floor`` the latency floor of a
    collective costing ``alpha_s + n * beta_s_per_byte`` (see the module docstring)."""
    total = sum(p.numel * torch.empty((), dtype=p.dtype).element_size() for p in params)
    lowest = max(AUTO_MIN_CAP, 2 * latency_floor_bytes(alpha_s, beta_s_per_byte))
    return int(min(max(AUTO_MAX_CAP, lowest), max(lowest, total // AUTO_TARGET_BUCKETS)))


def _aligned(numel: int, align_elems: int) -> int:
    return -(-numel // align_elems) * align_elems


def plan_buckets(
    params: Sequence[ParamSpec],
    ready_order: Sequence[str],
    *,
    cap_bytes: int = 25 * MIB,
    first_bucket_bytes: int | None = None,
    alignment_bytes: int = 512,
    unused: Sequence[str] = (),
    strict: bool = False,
    alpha_s: float = GLOO_ALPHA_S,
    beta_s_per_byte: float = GLOO_BETA_S_PER_BYTE,
    min_bucket_bytes: int | None = None,
) -> BucketPlan:
    """Plan buckets for ``params`` in ``ready_order`` (names; gradient-ready order).

    Parameters named in ``unused`` are left out (``strict=True`` makes that an error).
    Parameters missing from ``ready_order`` but not unused go last, in ``params`` order.
    A dtype change closes the current bucket; so does reaching the cap (the first
    bucket's cap is ``min(first_bucket_bytes, cap_bytes)``), once the bucket holds its
    floor: ``min_bucket_bytes`` (default: the latency floor of a collective costing
    ``alpha_s + n * beta_s_per_byte``, see the module docstring), at most half the cap.
    ``first_bucket_bytes=None`` is DDP's 1 MiB, whose bucket takes the floor too; a
    given ``first_bucket_bytes`` keeps its meaning (the first bucket's floor is at most
    half of it). A bucket under its floor takes the next parameter even past the cap; a
    parameter larger than the cap gets a bucket of its own.
    """
    if first_bucket_bytes is None:
        first_bucket_bytes, first_floor_cap = DEFAULT_FIRST_BUCKET, cap_bytes
    else:
        first_floor_cap = first_bucket_bytes
    if cap_bytes <= 0 or first_bucket_bytes <= 0:
        raise ConfigError(
            f"bucket caps must be > 0 bytes, got cap={cap_bytes}, first={first_bucket_bytes}"
        )
    if min_bucket_bytes is None:
        min_bucket_bytes = latency_floor_bytes(alpha_s, beta_s_per_byte)
    elif min_bucket_bytes < 0:
        raise ConfigError(f"min_bucket_bytes must be >= 0, got {min_bucket_bytes}")
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
    builder = _BucketBuilder(
        cap_bytes, first_bucket_bytes, alignment_bytes, min_bucket_bytes, first_floor_cap
    )
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
    def __init__(
        self, cap: int, first_cap: int, alignment: int, floor: int, first_floor_cap: int
    ) -> None:
        self.cap, self.first_cap, self.alignment = cap, min(first_cap, cap), alignment
        # an explicit small cap still splits: the floor is at most half of it
        self.floor = min(floor, cap // 2)
        self.first_floor = min(floor, min(first_floor_cap, cap) // 2)
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
        limit = self._limit()
        held = self.offset * size  # bytes the open bucket holds so far
        floor = self.first_floor if not self.buckets else self.floor
        full = self.slots and held >= floor and (start + param.numel) * size > limit
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
