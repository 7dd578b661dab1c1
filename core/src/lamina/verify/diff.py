"""Where the manifests of a job's ranks differ, and the one-line message that says so."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lamina.verify.manifest import Manifest

ABSENT = "<absent>"
"""Stands for a line (or a whole category) one side does not have."""

EMPTY = "<empty>"
"""Stands for a category one side holds with no lines, where the other lacks it."""

MAX_VALUE_CHARS = 160
"""Longest value a mismatch message shows in full; longer ones are cut around the change."""

FIX = "run the same script, configuration and world size on every rank"


@dataclass(frozen=True)
class Difference:
    """Ranks whose lines of one category differ from the reference rank's, and the first
    differing line (``index``) on each side (``<absent>`` past the end of a list)."""

    category: str
    ranks: tuple[int, ...]
    reference_rank: int
    index: int
    reference: str
    other: str


def _first_difference(ref: Manifest, other: Manifest, category: str) -> tuple[int, str, str]:
    a, b = ref.lines(category), other.lines(category)
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i, x, y
    i = min(len(a), len(b))
    if len(a) == len(b):  # same lines: one side holds the category empty, the other not
        return i, EMPTY if ref.has(category) else ABSENT, EMPTY if other.has(category) else ABSENT
    return i, a[i] if i < len(a) else ABSENT, b[i] if i < len(b) else ABSENT


def find_differences(manifests: Sequence[Manifest]) -> list[Difference]:
    """Every group of ranks that differs from the lowest rank, category by category.

    Per category (the reference rank's order, then categories only others hold) ranks
    are grouped by digest; the group holding the lowest rank is the reference and every other group
    gives one :class:`Difference` naming all its ranks, with the first line where its
    lowest rank differs from the reference rank.
    """
    if not manifests:
        return []
    ordered = sorted(manifests, key=lambda m: m.rank)
    reference = ordered[0]
    categories: list[str] = []
    for manifest in ordered:
        categories += [c for c in manifest.categories if c not in categories]
    found: list[Difference] = []
    for category in categories:
        groups: dict[str | None, list[Manifest]] = {}
        for manifest in ordered:
            key = manifest.digests().get(category)
            groups.setdefault(key, []).append(manifest)
        for members in groups.values():
            lowest = members[0]
            if lowest is reference:
                continue
            index, ref_line, other_line = _first_difference(reference, lowest, category)
            found.append(
                Difference(
                    category=category,
                    ranks=tuple(m.rank for m in members),
                    reference_rank=reference.rank,
                    index=index,
                    reference=ref_line,
                    other=other_line,
                )
            )
    return found


def _shown(value: str, against: str) -> str:
    """``value`` quoted; cut to about :data:`MAX_VALUE_CHARS` around where it first
    differs from ``against`` when it is longer."""
    if value in (ABSENT, EMPTY):
        return value
    if len(value) > MAX_VALUE_CHARS:
        at = next(
            (i for i, (x, y) in enumerate(zip(value, against, strict=False)) if x != y),
            min(len(value), len(against)),
        )
        start = max(0, min(at - 40, len(value) - MAX_VALUE_CHARS))
        cut = value[start : start + MAX_VALUE_CHARS]
        value = ("..." if start else "") + cut + ("..." if start + len(cut) < len(value) else "")
    return repr(value)


def format_mismatch(diffs: Sequence[Difference]) -> str:
    """One line: the first difference in full, the other differing categories by name,
    and the fix."""
    if not diffs:
        return "pre-flight verification: every rank agrees"
    first = diffs[0]
    also: list[str] = []
    for d in diffs[1:]:
        label = d.category if d.ranks == first.ranks else f"{d.category} (rank(s) {list(d.ranks)})"
        if label not in also:
            also.append(label)
    more = f" (also differ: {', '.join(also)})" if also else ""
    return (
        f"pre-flight verification failed: rank(s) {list(first.ranks)} differ from rank "
        f"{first.reference_rank} in {first.category} at item {first.index}: rank "
        f"{first.reference_rank} has {_shown(first.reference, first.other)}, rank "
        f"{first.ranks[0]} has {_shown(first.other, first.reference)}{more}; {FIX}"
    )
