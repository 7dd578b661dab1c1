"""The collective trace recorder: a bounded ring of events per process, cheap to keep on.

Every collective lamina issues goes through :meth:`TraceRecorder.collective` (via the
run log), which stamps the issue time and a per-group sequence number, and stamps the
completion time from the work's future (on CUDA a future completes when the device
work does) or, for a blocking call, when the call returns. Forward and backward
intervals are recorded as spans, so the report can tell hidden from exposed
communication. The newest ``capacity`` events are kept; ``dropped`` counts the rest.

``$LAMINA_TRACE=DIR`` starts a recorder in ``lamina.init()``; ``lamina.shutdown()``
writes ``DIR/rank<r>.jsonl``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lamina.errors import ConfigError
from lamina.trace.events import CollectiveEvent, SpanEvent, write_jsonl

TRACE_ENV = "LAMINA_TRACE"
CAPACITY_ENV = "LAMINA_TRACE_CAPACITY"
DEFAULT_CAPACITY = 65536

_ACTIVE: TraceRecorder | None = None
_INSIDE = threading.local()


class IssueHandle:
    """What the caller of :meth:`TraceRecorder.collective` fills in: the async ``work``."""

    __slots__ = ("event", "work")

    def __init__(self, event: CollectiveEvent | None) -> None:
        self.event = event
        self.work: Any = None


def inside_lamina_collective() -> bool:
    """True while this thread is issuing a collective lamina records itself."""
    return bool(getattr(_INSIDE, "depth", 0))


@contextmanager
def lamina_internal() -> Iterator[None]:
    """Mark this thread as issuing the parts of a collective lamina already recorded (an
    algorithm's phases on a worker thread), so user-collective tracing skips them."""
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1


class TraceRecorder:
    """Ring buffers of one rank's collectives and spans, plus where to write them."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        directory: str | Path | None = None,
        *,
        capacity: int = DEFAULT_CAPACITY,
        backend: str = "",
        pg_backend: str = "",
    ) -> None:
        if capacity < 1:
            raise ConfigError(f"trace capacity must be >= 1, got {capacity}")
        self.rank = rank
        self.world_size = world_size
        self.directory = Path(directory) if directory is not None else None
        self.capacity = capacity
        self.backend = backend
        self.pg_backend = pg_backend
        #: rank -> host name of every rank of the job (set by lamina.init from the
        #: topology), written into each file's meta.
        self.hosts: dict[int, str] = {}
        self._failed_dump = False
        self.enabled = True
        self.step = 0
        self.recorded = 0
        self._collectives: deque[CollectiveEvent] = deque(maxlen=capacity)
        self._spans: deque[SpanEvent] = deque(maxlen=capacity)
        self._seq: dict[tuple[int, ...], int] = {}
        self._lock = threading.Lock()

    # -- recording ----------------------------------------------------------------------
    @contextmanager
    def collective(
        self,
        *,
        op: str,
        group: tuple[int, ...],
        dtype: str,
        numel: int,
        nbytes: int,
        node: str,
        source: str = "lamina",
        wire: dict[str, int] | None = None,
    ) -> Iterator[IssueHandle]:
        """Record one collective around its issue; set ``handle.work`` for an async one.
        ``wire``: the bytes per dtype it hands to ``torch.distributed``, over all its calls."""
        if not self.enabled:
            yield IssueHandle(None)
            return
        with self._lock:
            seq = self._seq.get(group, 0)
            self._seq[group] = seq + 1
            event = CollectiveEvent(
                seq,
                self.rank,
                op,
                group,
                dtype,
                numel,
                nbytes,
                node,
                self.step,
                time.time_ns(),
                source=source,
                wire=dict(wire) if wire is not None else None,
            )
            self._collectives.append(event)
            self.recorded += 1
        handle = IssueHandle(event)
        _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
        try:
            yield handle
        except BaseException as exc:
            event.end_ns = time.time_ns()  # raised, not hung: never looks pending
            if isinstance(exc, Exception):
                self._dump_once(f"collective failed: {type(exc).__name__}")
            raise
        finally:
            _INSIDE.depth -= 1
        work = handle.work
        if work is None:
            event.end_ns = time.time_ns()
            return
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError):
            # a work without futures (some vendor process groups): its completion cannot
            # be observed; stamp the issue return so that it never looks hung
            event.end_ns = time.time_ns()
            return
        future.add_done_callback(lambda _f: _finish(event))

    @contextmanager
    def span(self, track: str, name: str) -> Iterator[SpanEvent | None]:
        """Record a compute or step interval around the block."""
        if not self.enabled:
            yield None
            return
        span = self.begin_span(track, name)
        try:
            yield span
        finally:
            span.end_ns = time.time_ns()

    def begin_span(self, track: str, name: str) -> SpanEvent:
        """Open a span now (close it by setting ``end_ns``)."""
        span = SpanEvent(self.rank, track, name, self.step, time.time_ns())
        if self.enabled:
            self._spans.append(span)
        return span

    # -- reading ------------------------------------------------------------------------
    def events(self) -> list[CollectiveEvent]:
        """The collectives in the ring, oldest first."""
        with self._lock:
            return list(self._collectives)

    def spans(self) -> list[SpanEvent]:
        """The spans in the ring, oldest first."""
        return list(self._spans)

    def pending(self) -> list[CollectiveEvent]:
        """Collectives issued and not (yet) completed, oldest first."""
        return [e for e in self.events() if e.end_ns is None]

    @property
    def dropped(self) -> int:
        """Collectives that fell out of the ring."""
        return max(0, self.recorded - len(self._collectives))

    # -- writing ------------------------------------------------------------------------
    def meta(self, reason: str) -> dict[str, Any]:
        """The meta record of a file written for ``reason``."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "pg_backend": self.pg_backend,
            "clock": "time_ns",
            "reason": reason,
            "capacity": self.capacity,
            "dropped": self.dropped,
            "written_ns": time.time_ns(),
            "host": socket.gethostname(),
            # where the job's store (torchrun's rendezvous) lives
            "store_host": os.environ.get("MASTER_ADDR", ""),
            "hosts": {str(r): h for r, h in sorted(self.hosts.items())},
        }

    def write(self, reason: str = "write", *, dump: bool = False) -> Path:
        """Write ``rank<r>.jsonl`` (``dump=True``: ``rank<r>.dump.jsonl``) into the directory."""
        if self.directory is None:
            raise ConfigError("this trace recorder has no directory; set LAMINA_TRACE=DIR")
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}.dump.jsonl" if dump else f"rank{self.rank}.jsonl"
        return write_jsonl(self.directory / name, self.meta(reason), self.events(), self.spans())

    def dump(self, reason: str) -> Path:
        """Write the ring as a hang dump (``rank<r>.dump.jsonl``)."""
        return self.write(reason, dump=True)

    def _dump_once(self, reason: str) -> None:
        """A collective raised (a peer died, a connection broke): leave this rank's ring
        for ``lamina trace diagnose`` once, never masking the error being raised."""
        if self._failed_dump or self.directory is None:
            return
        self._failed_dump = True
        with contextlib.suppress(Exception):  # the error in flight matters more
            self.dump(reason)


def _finish(event: CollectiveEvent) -> None:
    event.end_ns = time.time_ns()


def get_recorder() -> TraceRecorder | None:
    """The process's active recorder, or None when tracing is off."""
    return _ACTIVE


def start(recorder: TraceRecorder) -> TraceRecorder:
    """Make ``recorder`` the active one."""
    global _ACTIVE
    _ACTIVE = recorder
    return recorder


def stop(*, write: bool = True) -> Path | None:
    """Deactivate the recorder, writing its file first when it has a directory."""
    global _ACTIVE
    recorder, _ACTIVE = _ACTIVE, None
    if recorder is None or recorder.directory is None or not write:
        return None
    return recorder.write("shutdown")


def capacity_from_env() -> int:
    """``$LAMINA_TRACE_CAPACITY`` (ConfigError naming it when not a positive integer)."""
    raw = os.environ.get(CAPACITY_ENV, str(DEFAULT_CAPACITY))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{CAPACITY_ENV}={raw!r} must be a positive number of events")
    return value


def start_from_env(
    rank: int, world_size: int, backend: str, pg_backend: str
) -> TraceRecorder | None:
    """Start a recorder when ``$LAMINA_TRACE`` names a directory (called by ``lamina.init``)."""
    directory = os.environ.get(TRACE_ENV)
    if not directory:
        return None
    return start(
        TraceRecorder(
            rank,
            world_size,
            directory,
            capacity=capacity_from_env(),
            backend=backend,
            pg_backend=pg_backend,
        )
    )
