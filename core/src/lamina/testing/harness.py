"""Run a function on N real ranks for tests: free port, forwarded errors, bounded time.

Each rank is a fresh ``spawn`` process with the torchrun environment variables set
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), so
the function under test calls :func:`lamina.init` exactly as a torchrun-launched script
would. The first rank to raise stops the run: every other rank is killed and the
exception is re-raised in the parent with the rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

from lamina.errors import LaminaError

LOOPBACK = "127.0.0.1"


class RankFailure(LaminaError, AssertionError):
    """A rank raised or exited non-zero; ``rank`` and its ``details`` say which and why.

    ``error_type`` is the qualified name of the exception the rank raised (``None`` when
    it died without raising) and ``message`` its text.
    """

    def __init__(
        self, rank: int, details: str, error_type: str | None = None, message: str = ""
    ) -> None:
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.details = details
        self.error_type = error_type
        self.message = message


class RankTimeout(LaminaError, TimeoutError):
    """Ranks were still running when the time limit ran out; all were killed."""

    def __init__(self, ranks: Sequence[int], timeout: float) -> None:
        super().__init__(f"rank(s) {list(ranks)} still running after {timeout:.0f} s; killed")
        self.ranks = list(ranks)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        value = fn(*args)
    except BaseException as exc:
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        results.put((rank, "error", (traceback.format_exc(), kind, str(exc))))
        _shutdown_quietly()
        sys.exit(1)
    _shutdown_quietly()
    # plain pickle copies tensor data; the queue's own pickler would share tensors through
    # file descriptors that vanish when this process exits
    results.put((rank, "ok", pickle.dumps(value)))


def _shutdown_quietly() -> None:
    try:
        import lamina

        lamina.shutdown()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks and return their results by rank.

    ``fn`` must be importable by name (a module-level function) and its result picklable.
    ``env`` is added to every rank's environment, ``rank_env(rank)`` to one rank's.
    Raises :class:`RankFailure` for the first rank that fails and :class:`RankTimeout`
    when ``timeout`` seconds pass; in both cases every rank is killed first.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs: list[BaseProcess] = []
    for rank in range(world_size):
        rank_vars = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
            **(env or {}),
            **(rank_env(rank) if rank_env else {}),
        }
        proc = ctx.Process(target=_rank_main, args=(fn, args, rank_vars, results), daemon=True)
        proc.start()
        procs.append(proc)
    try:
        return _collect(procs, results, timeout)
    finally:
        _kill_all(procs)
        results.close()


def _collect(procs: list[BaseProcess], results: Any, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < len(procs):
        try:
            rank, status, payload = results.get(timeout=0.1)
        except queue.Empty:
            _check_dead(procs, values, results)
            if time.monotonic() > deadline:
                running = [r for r in range(len(procs)) if r not in values]
                raise RankTimeout(running, timeout) from None
            continue
        if status == "error":
            raise RankFailure(rank, *payload)
        values[rank] = pickle.loads(payload)
    for rank, proc in enumerate(procs):
        proc.join(timeout=10)
        if proc.exitcode not in (0, None):
            raise RankFailure(rank, f"exited with code {proc.exitcode} after returning")
    return [values[r] for r in range(len(procs))]


def _check_dead(procs: list[BaseProcess], values: dict[int, Any], results: Any) -> None:
    """A rank that died without reporting (signal, os._exit) fails the run."""
    for rank, proc in enumerate(procs):
        if rank in values or proc.is_alive() or proc.exitcode is None:
            continue
        try:  # its report may have arrived just after the last poll
            late_rank, status, payload = results.get(timeout=0.5)
        except queue.Empty:
            raise RankFailure(rank, f"died with exit code {proc.exitcode} (no report)") from None
        if status == "error":
            raise RankFailure(late_rank, *payload)
        values[late_rank] = pickle.loads(payload)


def _kill_all(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
