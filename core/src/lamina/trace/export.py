"""Chrome trace (Perfetto / chrome://tracing) of every rank's collectives and spans.

One process per rank (``pid`` = rank, named ``rank N``) with three threads:
``compute`` (forward/backward spans), ``communication`` (collectives) and ``steps``
(step spans and an instant ``step N`` marker at each step start). Times are
microseconds from the earliest timestamp of any rank. Anything never completed
(``end_ns`` null) is drawn up to that rank's last timestamp (its events' and the file's
``written_ns``) and carries ``args.pending = true``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lamina.trace.events import RankTrace, read_dir

#: Thread ids of the three tracks of a rank; other span tracks get ids after these.
THREADS: dict[str, int] = {"compute": 1, "communication": 2, "steps": 3}
_SPAN_THREAD = {"compute": "compute", "step": "steps"}


def _timestamps(trace: RankTrace) -> list[int]:
    stamps = [t for e in trace.collectives for t in (e.issue_ns, e.end_ns) if t is not None]
    stamps += [t for s in trace.spans for t in (s.start_ns, s.end_ns) if t is not None]
    return stamps


def last_ns(trace: RankTrace) -> int:
    """Where a pending interval is drawn up to: the rank's last timestamp (its events'
    and the file's ``written_ns``)."""
    stamps = _timestamps(trace)
    written = trace.meta.get("written_ns")
    if isinstance(written, int) and stamps and written >= min(stamps):
        stamps.append(written)
    return max(stamps, default=0)


def _meta(pid: int, tid: int | None, name: str, value: str, index: int) -> list[dict[str, Any]]:
    kind = "process" if tid is None else "thread"
    base: dict[str, Any] = {"ph": "M", "pid": pid}
    if tid is not None:
        base["tid"] = tid
    return [
        {**base, "name": f"{kind}_name", "args": {"name": value}},
        {**base, "name": f"{kind}_sort_index", "args": {"sort_index": index}},
    ]


def _complete(
    pid: int, tid: int, name: str, cat: str, span: tuple[int, int | None], origin: int, last: int
) -> dict[str, Any]:
    """A complete ("X") event; a pending one (end None) runs to ``last``, flagged."""
    start, end = span
    stop = last if end is None else end
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "name": name,
        "cat": cat,
        "ts": (start - origin) / 1000.0,
        "dur": max(0, stop - start) / 1000.0,
        "args": {"pending": True} if end is None else {},
    }


def _rank_events(rank: int, trace: RankTrace, origin: int) -> list[dict[str, Any]]:
    last = last_ns(trace)
    threads = dict(THREADS)
    for span in trace.spans:
        threads.setdefault(_SPAN_THREAD.get(span.track, span.track), len(threads) + 1)
    events = _meta(rank, None, "process", f"rank {rank}", rank)
    for name, tid in threads.items():
        events += _meta(rank, tid, "thread", name, tid)
    comm = threads["communication"]
    for e in trace.collectives:
        label = e.node if e.op in e.node else f"{e.op} ({e.node})"
        event = _complete(rank, comm, label, e.op, (e.issue_ns, e.end_ns), origin, last)
        event["args"].update(
            seq=e.seq,
            node=e.node,
            op=e.op,
            dtype=e.dtype,
            numel=e.numel,
            bytes=e.bytes,
            wire=e.wire,
            group=list(e.group),
            step=e.step,
            source=e.source,
        )
        events.append(event)
    starts: dict[int, int] = {}
    for s in trace.spans:
        tid = threads[_SPAN_THREAD.get(s.track, s.track)]
        name = f"step {s.step}" if s.track == "step" else s.name
        event = _complete(rank, tid, name, s.track, (s.start_ns, s.end_ns), origin, last)
        event["args"]["step"] = s.step
        events.append(event)
        if s.track == "step":
            starts[s.step] = min(starts.get(s.step, s.start_ns), s.start_ns)
    starts.update(_unspanned_step_starts(trace, starts))
    for step, start in sorted(starts.items()):
        events.append(
            {
                "ph": "i",
                "s": "t",
                "pid": rank,
                "tid": threads["steps"],
                "name": f"step {step}",
                "ts": (start - origin) / 1000.0,
                "args": {"step": step},
            }
        )
    return events


def chrome_trace(traces: dict[int, RankTrace]) -> dict[str, Any]:
    """The Chrome trace JSON object (``{"traceEvents": [...], ...}``) of all ranks."""
    origin = min((t for trace in traces.values() for t in _timestamps(trace)), default=0)
    events: list[dict[str, Any]] = []
    for rank, trace in sorted(traces.items()):
        events += _rank_events(rank, trace, origin)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"clock": "time_ns"}}


def _unspanned_step_starts(trace: RankTrace, spanned: dict[int, int]) -> dict[int, int]:
    """The first timestamp of each step that has no step span."""
    starts: dict[int, int] = {}
    points = [(e.step, e.issue_ns) for e in trace.collectives]
    points += [(s.step, s.start_ns) for s in trace.spans]
    for step, stamp in points:
        if step not in spanned:
            starts[step] = min(starts.get(step, stamp), stamp)
    return starts


def save_chrome_trace(traces: dict[int, RankTrace], path: str | Path) -> Path:
    """Write :func:`chrome_trace` of ``traces`` to ``path`` (atomically); returns it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(traces)))
    tmp.replace(target)
    return target


def write_chrome_trace(directory: str | Path, out: str | Path | None = None) -> Path:
    """Read ``directory``'s rank traces and write their Chrome trace (default
    ``DIR/trace.json``); returns the path written."""
    traces = read_dir(directory)
    return save_chrome_trace(traces, Path(directory) / "trace.json" if out is None else out)
