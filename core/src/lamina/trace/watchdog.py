"""The hang watchdog: a collective that never completes ends the job with a diagnosis.

``$LAMINA_COLLECTIVE_TIMEOUT=S`` (with ``$LAMINA_TRACE=DIR``) starts a daemon thread in
``lamina.init()`` that polls the trace recorder. When a collective has been pending for
more than ``S`` seconds, this rank dumps its ring buffer (``DIR/rank<r>.dump.jsonl``),
tells its peers through the job's store (key :data:`ABORT_KEY`), prints one line and
exits: a rank blocked in a collective cannot be unwound. Peers that read the key dump
their own rings and exit too, so ``lamina trace diagnose DIR`` sees every rank. Every
store call is given up after a few seconds, so a rank whose link to the store's host
is cut still fires.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lamina.envvars import positive_seconds
from lamina.errors import ConfigError
from lamina.trace.events import CollectiveEvent
from lamina.trace.recorder import TRACE_ENV, TraceRecorder

COLLECTIVE_TIMEOUT_ENV = "LAMINA_COLLECTIVE_TIMEOUT"
#: Store key a firing rank sets to its one-line description of the hang.
ABORT_KEY = "lamina/trace/abort"
#: Store counter of ranks that have dumped after a hang (so the store outlives the dumps).
EXITING_KEY = "lamina/trace/exiting"
DUMPED_KEY = "lamina/trace/dumped"
DEFAULT_EXIT_CODE = 71
#: Said in a dump's reason when the job's store did not answer the firing rank.
STORE_UNREACHABLE = "store unreachable"

_ACTIVE: Watchdog | None = None


class Watchdog:
    """Polls ``recorder`` for collectives pending longer than ``timeout_s``; see the module."""

    def __init__(
        self,
        recorder: TraceRecorder,
        timeout_s: float,
        store: Any | None = None,
        *,
        poll_s: float = 0.5,
        exit_code: int = DEFAULT_EXIT_CODE,
        store_poll_s: float = 1.0,
        grace_s: float = 5.0,
        store_call_s: float = 3.0,
    ) -> None:
        if not timeout_s > 0 or not math.isfinite(timeout_s):
            raise ConfigError(
                f"watchdog timeout must be a positive number of seconds, got {timeout_s}"
            )
        self.recorder = recorder
        self.timeout_s = timeout_s
        self.store: Any = store if store is not None else _default_store()
        self.poll_s = poll_s
        self.exit_code = exit_code
        self.store_poll_s = store_poll_s
        self.grace_s = grace_s
        self.store_call_s = store_call_s
        self.fired: str | None = None
        #: How the thread ends the process (tests replace it).
        self.exit: Callable[[int], None] = os._exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_store_poll = 0.0

    def start(self) -> Watchdog:
        """Start the daemon polling thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name=f"lamina-watchdog-rank{self.recorder.rank}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; call before the process group (and its store) is destroyed."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.poll_s + 5.0)

    # -- the polling loop ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check():
                return

    def check(self) -> bool:
        """One poll: fire on a local hang or a peer's report; True when it fired."""
        hung = self.overdue()
        if hung is not None:
            self._fire_local(hung)
            return True
        now = time.monotonic()
        if self.store is None or now < self._next_store_poll:
            return False
        self._next_store_poll = now + self.store_poll_s
        message = self._peer_report()
        if message is not None:
            self._fire_peer(message)
            return True
        return False

    def overdue(self) -> CollectiveEvent | None:
        """The oldest pending collective older than the timeout, if any."""
        pending = self.recorder.pending()
        if not pending:
            return None
        oldest = min(pending, key=lambda e: e.issue_ns)
        age = (time.time_ns() - oldest.issue_ns) / 1e9
        return oldest if age > self.timeout_s else None

    def _peer_report(self) -> str | None:
        raw = self._store_call(lambda s: s.get(ABORT_KEY) if s.check([ABORT_KEY]) else None)
        return None if raw is None else bytes(raw).decode(errors="replace")

    # -- firing ---------------------------------------------------------------------------
    def _fire_local(self, event: CollectiveEvent) -> None:
        rank = self.recorder.rank
        message = (
            f"rank {rank}: collective {event.describe()} did not complete within "
            f"{self.timeout_s:g} s"
        )
        self.fired = message
        where = self._dump("watchdog")  # before the peers hear of it: they dump after
        told = self._store_call(lambda s: (s.set(ABORT_KEY, message), True)[1])
        if not told:  # evidence: this rank's host lost the network; the dump says so
            where = self._dump(f"watchdog, {STORE_UNREACHABLE}")
        print(f"lamina: {message}; {where}", file=sys.stderr, flush=True)
        self._finish(fired_here=True)

    def _fire_peer(self, report: str) -> None:
        rank = self.recorder.rank
        pending = self.recorder.pending()
        own = (
            f"this rank waits in {min(pending, key=lambda e: e.issue_ns).describe()}"
            if pending
            else "this rank has no collective in flight"
        )
        self.fired = report
        where = self._dump("peer-watchdog")
        print(
            f"lamina: rank {rank}: a peer timed out ({report}); {own}; {where}",
            file=sys.stderr,
            flush=True,
        )
        self._finish(fired_here=False)

    def _dump(self, reason: str) -> str:
        try:
            path = self.recorder.dump(reason)
        except Exception as exc:  # still exit: a hung job must not hang on
            return f"the ring buffer could not be dumped ({exc})"
        self._store_call(lambda s: s.add(DUMPED_KEY, 1))
        folder = path.parent
        return f"ring buffers dumped to {folder}; run `lamina trace diagnose {folder}`"

    def _finish(self, *, fired_here: bool) -> None:
        """Give peers up to ``grace_s`` to dump (a store host must outlive them), then exit.

        The rank that fired exits first: a peer that exited before it would break the
        collective it is stuck in, and its main thread would die of that error instead
        of this clean exit. So peers wait (bounded) until it says it is leaving.
        """
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            done = self._store_call(lambda s: int(s.add(DUMPED_KEY, 0)))
            if done is None or done >= self.recorder.world_size:
                break
            time.sleep(0.05)
        if fired_here:
            self._store_call(lambda s: s.set(EXITING_KEY, str(self.recorder.rank)))
        else:
            while time.monotonic() < deadline + self.grace_s:
                if self._store_call(lambda s: bool(s.check([EXITING_KEY]))) in (None, True):
                    break
                time.sleep(0.05)
            time.sleep(0.2)  # the firing rank's os._exit follows its store write at once
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit(self.exit_code)

    def _store_call(self, call: Callable[[Any], Any]) -> Any:
        """``call(store)``, given up after ``store_call_s``: the store lives on another host,
        and a cut link would block the call (and this thread) for minutes. A store that
        failed or did not answer is not asked again (None from then on)."""
        store = self.store
        if store is None:
            return None
        answer: dict[str, Any] = {}

        def ask() -> None:
            try:
                answer["value"] = call(store)
            except Exception:  # the store's host went away: the job is ending anyway
                answer["failed"] = True

        asker = threading.Thread(target=ask, name="lamina-watchdog-store", daemon=True)
        asker.start()
        asker.join(self.store_call_s)
        if asker.is_alive() or "failed" in answer:
            self.store = None
            return None
        return answer.get("value")


def _default_store() -> Any | None:
    """The default process group's store, or None without one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def timeout_from_env() -> float | None:
    """``$LAMINA_COLLECTIVE_TIMEOUT`` in seconds, None when unset (ConfigError if invalid)."""
    return positive_seconds(COLLECTIVE_TIMEOUT_ENV, example=300)


def start_from_env(recorder: TraceRecorder | None) -> Watchdog | None:
    """Start a watchdog when ``$LAMINA_COLLECTIVE_TIMEOUT`` is set (called by ``lamina.init``)."""
    global _ACTIVE
    timeout = timeout_from_env()
    if timeout is None:
        return None
    if recorder is None or recorder.directory is None:
        raise ConfigError(f"{COLLECTIVE_TIMEOUT_ENV} needs {TRACE_ENV}=DIR for the dumps; set both")
    stop_active()
    _ACTIVE = Watchdog(recorder, timeout).start()
    return _ACTIVE


def active() -> Watchdog | None:
    """The watchdog :func:`start_from_env` started, or None."""
    return _ACTIVE


def stop_active() -> None:
    """Stop the active watchdog (``lamina.shutdown``, before the process group goes)."""
    global _ACTIVE
    watchdog, _ACTIVE = _ACTIVE, None
    if watchdog is not None:
        watchdog.stop()
