"""Run a function on N real ranks for tests: free port, forwarded errors, bounded time.

Each rank is a fresh process with the torchrun environment variables set (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), so the
function under test calls :func:`lamina.init` exactly as a torchrun-launched script
would. The first rank to raise stops the run: every other rank is killed and the
exception is re-raised in the parent with the rank's traceback.

Ranks start from a ``forkserver`` that has imported torch and lamina once (where the
platform has one): a rank then starts in milliseconds instead of paying torch's import
each time. Nothing but imports happens in the server, so no thread, device context or
process group is ever forked; each rank gets the caller's environment as it is at the
call, as a ``spawn``-ed rank would. ``start_method="spawn"`` gives a fresh interpreter.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

from lamina.errors import LaminaError

LOOPBACK = "127.0.0.1"
#: Modules the forkserver imports once, before it forks ranks: torch, what graph capture
#: imports on a rank's first ``distribute`` (torch.export and dynamo, ~1 s), and lamina's
#: own modules a rank loads on its first ``init`` and ``distribute`` (the package loads
#: them on first use: ~0.35 s of CPU a rank, measured, with every built-in strategy and
#: what they import, DCP and torch's pipelining among them).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.export",
    "torch._dynamo",
    "lamina",
    "lamina.session",
    "lamina.api",
    "lamina.strategies.dp",
    "lamina.strategies.zero3",
    "lamina.strategies.hsdp",
    "lamina.strategies.tp",
    "lamina.strategies.pp",
    "lamina.checkpoint.manager",
    "lamina.testing.harness",
)
#: Modules :func:`preload` added (the caller's heavy imports, e.g. transformers).
_EXTRA_PRELOAD: list[str] = []


def preload(*modules: str) -> None:
    """Have the forkserver also import ``modules`` once, so that every rank it forks has
    them instead of importing them itself (``transformers`` and ``peft`` cost a rank
    ~2.5 s of CPU). Takes effect when called before this process first starts ranks from
    the forkserver (a ``conftest.py`` at import is the place); a module that cannot be
    imported is skipped there, as :data:`PRELOAD`'s are."""
    _EXTRA_PRELOAD.extend(m for m in modules if m not in _EXTRA_PRELOAD)


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


#: Where Linux hands out ephemeral ports when ``/proc`` does not say (its default).
_DEFAULT_EPHEMERAL = (32768, 60999)
#: The lowest port :func:`free_port` picks: below it lie registered services' ports.
_LOWEST_PICK = 20000


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel picks for ``bind(0)`` and outgoing connections (Linux's
    ``ip_local_port_range``; the Linux default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago, outside the ephemeral range.

    The port is used later, by the rank that hosts the rendezvous store. A port from the
    ephemeral range (``bind(0)``'s answer) can be taken in between by any outgoing
    connection or by a gloo pair's listener, which all bind ports from that range: with
    several multi-rank jobs running at once that happened (EADDRINUSE at rendezvous).
    Ports outside it are handed out only on request, so just another explicit pick could
    take it; picks are random, so two concurrent ones rarely meet."""
    low, high = ephemeral_port_range()
    candidates = [
        *range(_LOWEST_PICK, max(_LOWEST_PICK, low)),
        *range(high + 1, 65536),
    ]
    rng = random.Random()  # not the global generator: tests seed that one
    port: int
    for port in rng.sample(candidates, min(len(candidates), 200)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: any port
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
    threads: int,
) -> None:
    os.environ.clear()  # the caller's environment now, not the forkserver's at its start
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        import torch

        torch.set_num_threads(threads)
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
    start_method: str | None = None,
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks and return their results by rank.

    ``fn`` must be importable by name (a module-level function) and its result picklable.
    ``env`` is added to every rank's environment, ``rank_env(rank)`` to one rank's.
    Raises :class:`RankFailure` for the first rank that fails and :class:`RankTimeout`
    when ``timeout`` seconds pass; in both cases every rank is killed first.
    ``start_method`` is ``"forkserver"`` (the default where available) or ``"spawn"``.
    ``threads`` is each rank's torch thread count; by default the machine's cores are
    shared among the ranks (at least one each), so ranks do not spin against each other
    on an oversubscribed CPU (torchrun sets ``OMP_NUM_THREADS=1`` for the same reason).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    elif threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    ctx = _context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs: list[BaseProcess] = []
    for rank in range(world_size):
        rank_vars = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
            **(env or {}),
            **(rank_env(rank) if rank_env else {}),
        }
        proc = ctx.Process(
            target=_rank_main, args=(fn, args, rank_vars, results, threads), daemon=True
        )
        proc.start()
        procs.append(proc)
    try:
        return _collect(procs, results, timeout)
    finally:
        _kill_all(procs)
        results.close()


def _context(start_method: str | None) -> Any:
    """The multiprocessing context ranks start from (see the module doc)."""
    available = mp.get_all_start_methods()
    method = start_method or ("forkserver" if "forkserver" in available else "spawn")
    if method not in ("forkserver", "spawn") or method not in available:
        usable = [m for m in ("forkserver", "spawn") if m in available]
        raise ValueError(
            f"start_method {method!r} is not usable here; choose one of {', '.join(usable)}"
        )
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([*PRELOAD, *_EXTRA_PRELOAD])
    return ctx


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
