"""Which collective primitive a plan node uses, decided once while planning.

A node asks for its preferred op (``reduce_scatter``, ``all_gather``); the answer is
that op or one of its declared alternatives, with the reason. The all-reduce forms (an
all-reduce of the full buffer followed by a slice, or of a zero-filled buffer holding
this rank's shard) work on every backend and are taken when:

- the op is disabled by configuration (``disable`` or ``$LAMINA_DISABLE_COLLECTIVES``,
  a comma-separated list of op names), e.g. to work around a broken vendor collective;
- the process-group backend lacks the op (``Backend.unsupported_collectives``);
- ``mode="all_reduce"`` asks for them, or ``mode="auto"`` on gloo with more than
  :data:`FEW_RANKS` ranks in the group.

``mode="auto"`` on gloo with up to :data:`FEW_RANKS` ranks takes the faster forms
(measured on 2 ranks, 16 MB, ``benchmarks/`` notes in :data:`GLOO_FORMS`): the gather
is one broadcast per rank of that rank's rows, the reduce-scatter an ``all_to_all``
followed by a local sum of the slots each rank received. Both move what the native op
moves, where gloo's all_gather and reduce_scatter are slower than an all-reduce that
moves twice the bytes.

Every rank must decide the same way; the pre-flight verifier compares the plans.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from lamina.errors import ConfigError

DISABLE_ENV = "LAMINA_DISABLE_COLLECTIVES"
PrimitiveMode = Literal["auto", "native", "all_reduce"]
PRIMITIVE_MODES: tuple[str, ...] = ("auto", "native", "all_reduce")
#: Ops that have an all-reduce based alternative.
REPLACEABLE: tuple[str, ...] = ("reduce_scatter", "all_gather")
KNOWN_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
#: What each alternative op does in place of the requested one: {requested: {op: how}}.
ALTERNATIVES: dict[str, dict[str, str]] = {
    "all_gather": {
        "all_reduce": "all_reduce of a zero-filled buffer",
        "broadcast": "one broadcast per rank",
    },
    "reduce_scatter": {
        "all_reduce": "all_reduce + slice",
        "all_to_all": "all_to_all + local sum",
    },
}
#: The faster forms on gloo ``mode="auto"`` takes, with the measurement that chose them
#: (2 ranks, 16 MB, one thread each; ``all_reduce`` of the same buffer ~19 ms).
GLOO_FORMS: dict[str, tuple[str, str]] = {
    "all_gather": (
        "broadcast",
        "gloo: one broadcast per rank is faster than all_gather (16 MB, 2 ranks: ~8 vs ~11 ms)",
    ),
    "reduce_scatter": (
        "all_to_all",
        "gloo: all_to_all + local sum is faster than "
        "reduce_scatter (16 MB, 2 ranks: ~12 vs ~24 ms)",
    ),
}
#: Up to this many ranks in the group, gloo takes :data:`GLOO_FORMS` (one broadcast per
#: rank stops paying off as the group grows); beyond it, the all-reduce forms.
FEW_RANKS = 8


@dataclass(frozen=True)
class PrimitiveChoice:
    """The op a node issues: ``requested`` itself, or an alternative from
    :data:`ALTERNATIVES` with ``reason``."""

    requested: str
    op: str
    reason: str = ""

    @property
    def fell_back(self) -> bool:
        """True when the alternative replaced the requested op."""
        return self.op != self.requested

    @property
    def alternative(self) -> str:
        """What the node does instead of the requested op, when it falls back (else the
        all-reduce form it would fall back to)."""
        forms = ALTERNATIVES[self.requested]
        return forms.get(self.op, forms["all_reduce"])


def disabled_from_env(environ: dict[str, str] | None = None) -> frozenset[str]:
    """Op names listed in ``$LAMINA_DISABLE_COLLECTIVES`` (ConfigError on unknown names)."""
    raw = (environ if environ is not None else dict(os.environ)).get(DISABLE_ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - set(KNOWN_OPS))
    if unknown:
        raise ConfigError(
            f"{DISABLE_ENV}={raw!r} names unknown collectives {unknown}; "
            f"use a comma-separated subset of {list(REPLACEABLE)}"
        )
    return names


def choose_primitive(
    op: str,
    pg_backend: str,
    *,
    mode: str = "auto",
    disable: Iterable[str] = (),
    unsupported: Iterable[str] = (),
    group_size: int = 2,
) -> PrimitiveChoice:
    """The primitive for a node that wants ``op`` on a ``pg_backend`` process group of
    ``group_size`` ranks."""
    if mode not in PRIMITIVE_MODES:
        raise ConfigError(f"collectives={mode!r} is not one of {list(PRIMITIVE_MODES)}")
    if op not in REPLACEABLE:
        raise ConfigError(
            f"collective {op!r} has no declared alternative; use one of {REPLACEABLE}"
        )
    disabled = set(disable)
    missing = set(unsupported)
    if op in disabled:
        return PrimitiveChoice(op, "all_reduce", f"{op} disabled by configuration ({DISABLE_ENV})")
    if op in missing:
        return PrimitiveChoice(op, "all_reduce", f"the {pg_backend} process group lacks {op}")
    if mode == "all_reduce":
        return PrimitiveChoice(op, "all_reduce", "collectives='all_reduce' requested")
    if mode == "auto" and pg_backend == "gloo":
        if group_size <= FEW_RANKS:
            return PrimitiveChoice(op, *GLOO_FORMS[op])
        return PrimitiveChoice(
            op,
            "all_reduce",
            f"gloo: all_reduce is faster than {op} (64 MB, 2 ranks: ~75 vs ~140 ms) and "
            f"{group_size} ranks are too many for one broadcast each",
        )
    return PrimitiveChoice(op, op)
