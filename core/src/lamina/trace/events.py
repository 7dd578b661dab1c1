"""Trace records: collectives and compute spans, and their JSONL files.

A trace directory holds ``rank<r>.jsonl`` (written at shutdown) and, after a hang,
``rank<r>.dump.jsonl`` (written by the watchdog). Each file starts with a meta record;
every other line is a collective or a span. Times are ``time.time_ns()``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lamina.errors import ConfigError

#: Bus-bandwidth factor per op for a group of ``n`` ranks (the nccl-tests convention).
BUSBW_FACTORS: dict[str, str] = {
    "all_reduce": "2(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_gather": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
}


def busbw_factor(op: str, n: int) -> float:
    """The factor that turns algorithm bandwidth into bus bandwidth for ``op`` on ``n`` ranks."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass
class CollectiveEvent:
    """One collective as one rank saw it; ``end_ns`` is None until it completes."""

    seq: int
    rank: int
    op: str
    group: tuple[int, ...]
    dtype: str
    numel: int
    bytes: int
    node: str
    step: int
    issue_ns: int
    end_ns: int | None = None
    source: str = "lamina"
    #: a compressed collective's statistics (fp8: counts, errors, whether it was used)
    codec: dict[str, Any] | None = None
    #: what this rank handed to ``torch.distributed`` for it, bytes per dtype name, over
    #: every call it made (each phase of a multi-phase algorithm or codec; a call counts
    #: as ``bytes`` does); None where the recorder was not told
    wire: dict[str, int] | None = None

    @property
    def seconds(self) -> float | None:
        """Issue to completion, or None while pending."""
        return None if self.end_ns is None else (self.end_ns - self.issue_ns) / 1e9

    @property
    def wire_bytes(self) -> int | None:
        """Bytes this rank handed to ``torch.distributed`` for it, every dtype (None: not
        recorded)."""
        return None if self.wire is None else sum(self.wire.values())

    def describe(self) -> str:
        """``#12 bucket3.all_reduce (all_reduce float32 x 1024, 4096 B, group [0, 1])``."""
        return (
            f"#{self.seq} {self.node} ({self.op} {self.dtype} x {self.numel}, {self.bytes} B, "
            f"group {list(self.group)})"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {"type": "collective", **asdict(self), "group": list(self.group)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectiveEvent:
        """Read a record made by :meth:`to_json`."""
        fields = {k: v for k, v in data.items() if k != "type"}
        fields["group"] = tuple(int(r) for r in fields["group"])
        return cls(**fields)


@dataclass
class SpanEvent:
    """A compute interval (``track="compute"``: forward, backward) or a whole step."""

    rank: int
    track: str
    name: str
    step: int
    start_ns: int
    end_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {"type": "span", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpanEvent:
        """Read a record made by :meth:`to_json`."""
        return cls(**{k: v for k, v in data.items() if k != "type"})


@dataclass
class RankTrace:
    """Everything one rank's file holds."""

    meta: dict[str, Any]
    collectives: list[CollectiveEvent] = field(default_factory=list)
    spans: list[SpanEvent] = field(default_factory=list)


def write_jsonl(
    path: Path, meta: dict[str, Any], collectives: list[CollectiveEvent], spans: list[SpanEvent]
) -> Path:
    """Write one rank's trace atomically (a temporary file renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as out:
        out.write(json.dumps({"type": "meta", **meta}) + "\n")
        for event in collectives:
            out.write(json.dumps(event.to_json()) + "\n")
        for span in spans:
            out.write(json.dumps(span.to_json()) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: Path) -> RankTrace:
    """Read one rank's trace file; ConfigError naming the file and line when malformed."""
    trace: RankTrace | None = None
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"trace file {path} cannot be read ({exc})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            kind = record["type"]
            if kind == "meta":
                trace = RankTrace({k: v for k, v in record.items() if k != "type"})
            elif trace is None:
                raise ValueError("the first record must be the meta record")
            elif kind == "collective":
                trace.collectives.append(CollectiveEvent.from_json(record))
            elif kind == "span":
                trace.spans.append(SpanEvent.from_json(record))
            else:
                raise ValueError(f"unknown record type {kind!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"trace file {path} line {number} is malformed ({exc}); it must be written "
                "by lamina's trace recorder"
            ) from None
    if trace is None:
        raise ConfigError(f"trace file {path} is empty; it must be written by lamina's recorder")
    return trace


def read_dir(directory: str | Path, prefer: str = "normal") -> dict[int, RankTrace]:
    """Every rank's trace in ``directory``: ``rank<r>.jsonl``, or its ``.dump.jsonl``
    where only that exists (``prefer="dump"`` reverses the preference)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(f"trace directory {folder} does not exist; pass the LAMINA_TRACE folder")
    found: dict[int, dict[str, Path]] = {}
    for path in folder.glob("rank*.jsonl"):
        stem = path.name.removeprefix("rank").removesuffix(".jsonl")
        kind = "normal"
        if stem.endswith(".dump"):
            stem, kind = stem.removesuffix(".dump"), "dump"
        if stem.isdigit():
            found.setdefault(int(stem), {})[kind] = path
    if not found:
        raise ConfigError(
            f"trace directory {folder} holds no rank<N>.jsonl files; run with LAMINA_TRACE={folder}"
        )
    other = "dump" if prefer == "normal" else "normal"
    return {
        rank: read_jsonl(paths.get(prefer) or paths[other]) for rank, paths in sorted(found.items())
    }
