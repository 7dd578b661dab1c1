"""Collective tracing: a recorder every lamina collective goes through, trace files,
and (in submodules) export, analysis, the hang watchdog and its diagnosis.

``$LAMINA_TRACE=DIR`` turns recording on in ``lamina.init()``; ``lamina.shutdown()``
writes ``DIR/rank<r>.jsonl``. See ``lamina trace report`` / ``lamina trace diagnose``.
"""

from lamina.trace.events import (
    BUSBW_FACTORS,
    CollectiveEvent,
    RankTrace,
    SpanEvent,
    busbw_factor,
    read_dir,
    read_jsonl,
)
from lamina.trace.recorder import TraceRecorder, get_recorder, start, stop

__all__ = [
    "BUSBW_FACTORS",
    "CollectiveEvent",
    "RankTrace",
    "SpanEvent",
    "TraceRecorder",
    "busbw_factor",
    "get_recorder",
    "read_dir",
    "read_jsonl",
    "start",
    "stop",
]
