"""Asynchronous collective works (shared by ``comm`` and ``memory``, which may not import
each other): several works waited for as one, and collectives run in order on one
worker thread, waited for like a torch ``Work``."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch


class AllWorks:
    """Waits for every work it holds (``None`` entries are skipped)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self) -> bool:
        """Wait for every work."""
        for work in self.works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """A future that completes when every work has (for the trace recorder)."""
        return torch.futures.collect_all([w.get_future() for w in self.works])


class ThreadWork:
    """A collective run on a worker thread, waited for like a torch ``Work``."""

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def wait(self) -> bool:
        """Block until the collective finished (re-raising its error)."""
        self._future.result()
        return True

    def is_completed(self) -> bool:
        """True once the collective finished."""
        return self._future.done()

    def get_future(self) -> torch.futures.Future[None]:
        """A torch future completed with the collective (for the trace recorder)."""
        done: torch.futures.Future[None] = torch.futures.Future()

        def finish(f: concurrent.futures.Future[None]) -> None:
            error = f.exception()
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)  # type: ignore[arg-type]

        self._future.add_done_callback(finish)
        return done


class SerialWorker:
    """One thread that runs collectives in the order they were submitted. On gloo a
    multi-phase collective must wait for one phase before issuing the next; running
    every such collective of a job on one thread keeps the issue order equal on every
    rank (the order the ranks submit in)."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, run: Callable[[], None]) -> ThreadWork:
        """Run ``run`` after everything submitted before it."""
        return ThreadWork(self._pool.submit(run))

    def close(self) -> None:
        """Finish what was submitted and stop the thread."""
        self._pool.shutdown(wait=True)
