"""``lamina trace diagnose DIR``: which rank stopped where, from every rank's trace.

Reads each rank's file (the hang dump where there is one), then, per process group,
lines the ranks' collectives up by sequence number and reports the earliest place
where they part: a collective some members entered and others never did, one the
members entered with different ops or shapes, or one every member entered that never
completed on some. Ranks with no file at all are named too. Works for any backend:
it only needs the trace files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lamina.errors import LaminaError
from lamina.trace.events import CollectiveEvent, RankTrace, read_dir
from lamina.trace.watchdog import STORE_UNREACHABLE
from lamina.units import format_bytes


@dataclass
class Finding:
    """One problem: ``kind`` is ``network``, ``no_trace``, ``mismatch``, ``not_entered``
    or ``not_completed``; ``message`` says it in one line."""

    kind: str
    message: str
    group: tuple[int, ...] = ()
    seq: int | None = None
    node: str = ""
    op: str = ""
    dtype: str = ""
    numel: int = 0
    bytes: int = 0
    entered_by: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    completed_by: list[int] = field(default_factory=list)
    #: rank -> its last collective on the group (``describe()``), for the ranks missing.
    last: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return {
            "kind": self.kind,
            "message": self.message,
            "group": list(self.group),
            "seq": self.seq,
            "node": self.node,
            "op": self.op,
            "dtype": self.dtype,
            "numel": self.numel,
            "bytes": self.bytes,
            "entered_by": self.entered_by,
            "missing": self.missing,
            "completed_by": self.completed_by,
            "last": {str(r): d for r, d in self.last.items()},
        }


@dataclass
class Diagnosis:
    """The verdict on one trace directory."""

    directory: Path
    world_size: int
    ok: bool
    findings: list[Finding]
    #: rank -> where its events came from, e.g. ``dump (watchdog)``.
    sources: dict[int, str]
    groups: int = 0
    collectives: int = 0

    def lines(self) -> list[str]:
        """A header line, then one line per finding (or the all-clear)."""
        sources = ", ".join(f"rank {r}: {s}" for r, s in self.sources.items())
        head = (
            f"trace {self.directory}: {len(self.sources)} of {self.world_size} rank(s) ({sources})"
        )
        if self.ok:
            return [
                head,
                f"OK: all {self.world_size} ranks completed the same {self.collectives} "
                f"collectives on every group ({self.groups} group(s))",
            ]
        return [head] + [f"PROBLEM: {f.message}" for f in self.findings]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "directory": str(self.directory),
            "world_size": self.world_size,
            "ok": self.ok,
            "groups": self.groups,
            "collectives": self.collectives,
            "sources": {str(r): s for r, s in self.sources.items()},
            "findings": [f.to_json() for f in self.findings],
        }


def diagnose(directory: str | Path) -> Diagnosis:
    """Read every rank's trace in ``directory`` and find where the ranks parted."""
    folder = Path(directory)
    traces = read_dir(folder, prefer="dump")
    world = max([int(t.meta.get("world_size", 0)) for t in traces.values()] + [max(traces) + 1])
    findings: list[Finding] = []
    hosts = _hosts(traces)
    cut_off = [r for r, t in traces.items() if STORE_UNREACHABLE in str(t.meta.get("reason"))]
    if cut_off:
        store_host = next((str(t.meta["store_host"]) for t in traces.values()
                           if t.meta.get("store_host")), "the store's host")  # fmt: skip
        findings.append(
            Finding(
                "network",
                f"rank(s) {cut_off}{_on_hosts(cut_off, hosts)} could not reach the job's store "
                f"on {store_host} when their watchdog fired: the network between them and "
                f"{store_host} failed (a cut link, a dead port); the other ranks waited for "
                "them",
                missing=cut_off,
            )
        )
    absent = [r for r in range(world) if r not in traces]
    if absent:
        findings.append(
            Finding(
                "no_trace",
                f"no trace from rank(s) {absent}{_on_hosts(absent, hosts)}: it died or "
                "never traced",
                missing=absent,
            )
        )
    groups = sorted({e.group for t in traces.values() for e in t.collectives})
    total = 0
    for group in groups:
        finding, count = _check_group(group, traces)
        total += count
        if finding is not None:
            findings.append(finding)
    sources = {r: _source(folder, r, t) for r, t in traces.items()}
    return Diagnosis(folder, world, not findings, findings, sources, len(groups), total)


def _hosts(traces: dict[int, RankTrace]) -> dict[int, str]:
    """rank -> host name, from the ranks' own meta and the job's host map in any meta."""
    hosts: dict[int, str] = {}
    for trace in traces.values():
        for rank, host in dict(trace.meta.get("hosts") or {}).items():
            hosts[int(rank)] = str(host)
    for rank, trace in traces.items():
        if trace.meta.get("host"):
            hosts[rank] = str(trace.meta["host"])
    return hosts


def _on_hosts(ranks: Sequence[int], hosts: dict[int, str]) -> str:
    """`` on host(s) a, b`` for ``ranks`` whose hosts are known, else empty."""
    names = sorted({hosts[r] for r in ranks if r in hosts})
    return f" on host(s) {', '.join(names)}" if names else ""


def _source(folder: Path, rank: int, trace: RankTrace) -> str:
    kind = "dump" if (folder / f"rank{rank}.dump.jsonl").is_file() else "trace"
    return f"{kind} ({trace.meta.get('reason', '?')})"


def _signature(event: CollectiveEvent) -> tuple[object, ...]:
    numel = None if event.op == "all_to_all" else event.numel  # uneven splits are legal
    return (event.op, event.node, event.dtype, numel)


def _what(event: CollectiveEvent) -> str:
    return f"{event.op} {event.dtype} x {event.numel}, {format_bytes(event.bytes)}"


def _check_group(
    group: tuple[int, ...], traces: dict[int, RankTrace]
) -> tuple[Finding | None, int]:
    """The earliest problem on ``group`` (or None) and how many collectives it ran."""
    members = [r for r in group if r in traces]
    by_seq = {r: {e.seq: e for e in traces[r].collectives if e.group == group} for r in members}
    last = {r: max(seqs, default=-1) for r, seqs in by_seq.items()}
    count = max(last.values(), default=-1) + 1
    if not members:
        return None, 0
    candidates: list[tuple[int, int, Finding]] = []
    common = sorted(set.intersection(*(set(s) for s in by_seq.values())))
    for seq in common:
        events = {r: by_seq[r][seq] for r in members}
        if len({_signature(e) for e in events.values()}) > 1:
            candidates.append((seq, 0, _mismatch(group, seq, events)))
            break
    low, high = min(last.values()), max(last.values())
    if low < high:
        candidates.append((low + 1, 1, _not_entered(group, low + 1, by_seq, last, traces)))
    for seq in common:
        events = {r: by_seq[r][seq] for r in members}
        stuck = [r for r, e in events.items() if e.end_ns is None]
        if stuck:
            candidates.append((seq, 2, _not_completed(group, seq, events, stuck, traces)))
            break
    if not candidates:
        return None, count
    return min(candidates, key=lambda c: (c[0], c[1]))[2], count


def _located(finding: Finding, event: CollectiveEvent) -> Finding:
    finding.node, finding.op, finding.dtype = event.node, event.op, event.dtype
    finding.numel, finding.bytes = event.numel, event.bytes
    return finding


def _mismatch(group: tuple[int, ...], seq: int, events: dict[int, CollectiveEvent]) -> Finding:
    kinds: dict[str, list[int]] = {}
    for rank, event in events.items():
        kinds.setdefault(f"{event.node} ({_what(event)})", []).append(rank)
    said = "; ".join(f"rank(s) {ranks} issued {what}" for what, ranks in kinds.items())
    message = (
        f"collective #{seq} on group {list(group)} differs between ranks: {said}; their "
        "collective sequences diverged here (run `lamina verify` on the script)"
    )
    first = events[min(events)]
    finding = Finding("mismatch", message, group, seq, entered_by=sorted(events))
    return _located(finding, first)


def _not_entered(
    group: tuple[int, ...],
    seq: int,
    by_seq: dict[int, dict[int, CollectiveEvent]],
    last: dict[int, int],
    traces: dict[int, RankTrace],
) -> Finding:
    entered = sorted(r for r, n in last.items() if n >= seq)
    missing = sorted(r for r, n in last.items() if n < seq)
    event = next((by_seq[r][seq] for r in entered if seq in by_seq[r]), None)
    what = f"#{seq}" if event is None else f"#{seq} {event.node} ({_what(event)})"
    lasts: dict[int, str] = {}
    notes = []
    for rank in missing:
        if last[rank] < 0:
            dropped = int(traces[rank].meta.get("dropped", 0))
            hint = f" (its ring dropped {dropped} events)" if dropped else ""
            notes.append(f"rank {rank} never entered a collective on that group{hint}")
            continue
        previous = by_seq[rank][last[rank]]
        lasts[rank] = previous.describe()
        state = "" if previous.end_ns is not None else ", still waiting in it"
        notes.append(
            f"rank {rank}'s last collective on that group was #{previous.seq} {previous.node}"
            f"{state}"
        )
    message = (
        f"collective {what} on group {list(group)} was entered by rank(s) {entered} and never "
        f"by rank(s) {missing}; " + "; ".join(notes)
    )
    finding = Finding(
        "not_entered", message, group, seq, entered_by=entered, missing=missing, last=lasts
    )
    return finding if event is None else _located(finding, event)


def _not_completed(
    group: tuple[int, ...],
    seq: int,
    events: dict[int, CollectiveEvent],
    stuck: list[int],
    traces: dict[int, RankTrace],
) -> Finding:
    done = sorted(r for r in events if r not in stuck)
    event = events[stuck[0]]
    untraced = [r for r in group if r not in traces]
    who = "every traced member" if untraced else "every member"
    where = f"it completed on rank(s) {done}" if done else "it completed on no rank"
    if untraced:
        where += f"; rank(s) {untraced} left no trace"
    message = (
        f"collective #{seq} {event.node} ({_what(event)}) on group {list(group)} was entered "
        f"by {who} but never completed on rank(s) {stuck}; {where}"
    )
    finding = Finding(
        "not_completed",
        message,
        group,
        seq,
        entered_by=sorted(events),
        missing=untraced,
        completed_by=done,
    )
    return _located(finding, event)


# -- command line (``lamina trace diagnose``; also ``python -m lamina.trace.diagnose``) ----
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``lamina trace diagnose``."""
    parser.add_argument("directory", metavar="DIR", help="the LAMINA_TRACE directory")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def command(args: argparse.Namespace) -> int:
    """Print the diagnosis of ``args.directory``; 0 when the ranks agree, 1 otherwise."""
    result = diagnose(args.directory)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print("\n".join(result.lines()))
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lamina.trace.diagnose DIR [--json]``."""
    parser = argparse.ArgumentParser(
        prog="lamina trace diagnose",
        description="Find where the ranks of a traced job parted (hang or divergence).",
    )
    add_arguments(parser)
    try:
        return command(parser.parse_args(argv))
    except LaminaError as exc:
        print(f"lamina: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
