"""Pre-flight check: before the first collective every rank proves it runs the same thing.

Two steps, both bounded. First every rank checks in through the default process group's
store and waits (at most ``LAMINA_VERIFY_TIMEOUT`` seconds) for the others, so that a
rank which never comes is named on every rank that did instead of hanging the job.
Then the ranks all-gather their manifests' digests (a few hundred bytes); only when they
differ do they exchange the manifests themselves, and every rank raises the same
:class:`~lamina.errors.VerificationError` naming the ranks and the first differing line.

The arrival is one store counter that a rank giving up also poisons (it adds
``world + 1``), so that the decision is the same on every rank: either the last rank to
arrive saw no one give up and releases everybody, or every rank fails.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from lamina.envvars import VERIFY_TIMEOUT_ENV, positive_seconds
from lamina.errors import ConfigError, VerificationError
from lamina.verify.diff import find_differences, format_mismatch
from lamina.verify.manifest import Manifest

logger = logging.getLogger("lamina.verify")

TIMEOUT_ENV = VERIFY_TIMEOUT_ENV
DEFAULT_TIMEOUT = 120.0
GRACE = 10.0
"""Seconds a rank waits for a verdict another rank is about to write."""
LINGER = 5.0
"""Seconds a failing rank waits for the others to read the verdict before it raises."""

_CALLS = itertools.count(1)
_OK = "ok"


@dataclass(frozen=True)
class PreflightReport:
    """A passed pre-flight check: how many ranks agreed, on what, in how long."""

    world_size: int
    categories: tuple[str, ...]
    seconds: float

    def summary(self) -> str:
        """One line for the log."""
        if self.world_size <= 1:
            return f"pre-flight verification: 1 rank, nothing to compare ({self.seconds:.2f} s)"
        return (
            f"pre-flight verification: {self.world_size} ranks agree on "
            f"{', '.join(self.categories)} ({self.seconds:.2f} s)"
        )


def verify_timeout(timeout: float | None = None) -> float:
    """``timeout``, else ``$LAMINA_VERIFY_TIMEOUT``, else 120 s; ConfigError if not > 0."""
    if timeout is None:
        value = positive_seconds(TIMEOUT_ENV, example=DEFAULT_TIMEOUT)
        return DEFAULT_TIMEOUT if value is None else value
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ConfigError(
            f"preflight timeout must be a positive number of seconds, got {timeout!r}"
        )
    return float(timeout)


def preflight(
    manifest: Manifest,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> PreflightReport:
    """Check that every rank of ``group`` (default: all) holds an equal manifest.

    Collective: every rank must call it. Returns a report when all agree; raises
    :class:`~lamina.errors.VerificationError` on every rank when one differs or a rank
    does not arrive within ``timeout`` seconds (default ``$LAMINA_VERIFY_TIMEOUT``, 120).
    """
    started = time.monotonic()
    limit = verify_timeout(timeout)
    if not (dist.is_available() and dist.is_initialized()):
        return _passed(PreflightReport(1, manifest.categories, time.monotonic() - started))
    rank = dist.get_rank()
    if group is not None and dist.get_rank(group) < 0:
        raise ConfigError(f"rank {rank} is not in the group given to preflight; pass one it is in")
    if dist.get_world_size(group) <= 1 or dist.get_backend(group) == "fake":
        # one rank, or a planning process alone on a fake group: nothing to compare with
        return _passed(PreflightReport(1, manifest.categories, time.monotonic() - started))
    if manifest.rank != rank:
        raise ConfigError(
            f"the manifest was built for rank {manifest.rank} but this process is rank {rank}; "
            "build it with dist.get_rank()"
        )
    members = tuple(dist.get_process_group_ranks(group)) if group is not None else None
    members = members or tuple(range(dist.get_world_size()))
    # the members in the keys: groups that check at once (a pipeline's stages) count apart
    group_key = ",".join(map(str, members))
    _arrive(rank, members, limit, f"lamina/preflight/{next(_CALLS)}/{group_key}/")

    mine = manifest.digest_bytes()
    device = _device_for(group)
    local = torch.tensor(list(mine), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(local) for _ in members]
    dist.all_gather(gathered, local, group=group)
    if all(bytes(t.cpu().tolist()) == mine for t in gathered):
        report = PreflightReport(len(members), manifest.categories, time.monotonic() - started)
        return _passed(report)

    dicts: list[object] = [None] * len(members)
    dist.all_gather_object(dicts, manifest.to_dict(), group=group)
    manifests = [Manifest.from_dict(d) for d in dicts if isinstance(d, dict)]
    raise VerificationError(format_mismatch(find_differences(manifests)))


def _passed(report: PreflightReport) -> PreflightReport:
    logger.info("%s", report.summary())
    return report


def _device_for(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors: CPU for gloo, else the current device."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _arrive(rank: int, members: tuple[int, ...], limit: float, prefix: str) -> None:
    """Check in and wait for every member; raise VerificationError on every rank if one is
    missing after ``limit`` seconds."""
    store = dist.distributed_c10d._get_default_store()
    try:
        failure = _decide(store, rank, members, limit, prefix)
    except dist.DistError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise VerificationError(
            f"pre-flight verification: the rendezvous store stopped answering ({first}); "
            "rank 0, which hosts it, may have exited — check its log"
        ) from None
    if failure is not None:
        _linger(store, prefix, len(members) + 1)
        raise VerificationError(failure)


def _decide(
    store: Store, rank: int, members: tuple[int, ...], limit: float, prefix: str
) -> str | None:
    """None once every member arrived; else the failure message all ranks raise."""
    n, poison = len(members), len(members) + 1
    counter, verdict = f"{prefix}count", f"{prefix}verdict"
    store.set(f"{prefix}arrived/{rank}", "1")
    count = store.add(counter, 1)
    if count // poison:  # someone gave up before this rank arrived
        return _verdict_or(store, verdict, _late(rank, limit))
    if count == n:  # last to arrive, and nobody gave up: release everybody
        store.set(verdict, _OK)
        return None
    if _poll(store, verdict, limit):
        found = _read(store, verdict)
        return None if found == _OK else found
    count = store.add(counter, poison)  # give up, so that late arrivals fail too
    if count % poison == n:  # everybody did arrive before that: follow the verdict
        found = _verdict_or(store, verdict, _late(rank, limit))
        return None if found == _OK else found
    message = _missing(store, prefix, members, limit)
    store.set(verdict, message)
    return message


def _linger(store: Store, prefix: str, poison: int) -> None:
    """Acknowledge a failed check, then wait (at most :data:`LINGER` s) until every rank
    that arrived has, so that the rank hosting the store does not exit under the others
    while they still read the verdict."""
    acks, counter = f"{prefix}acks", f"{prefix}count"
    deadline, pause = time.monotonic() + LINGER, 0.005
    try:
        store.add(acks, 1)
        while time.monotonic() < deadline:
            if store.add(acks, 0) >= store.add(counter, 0) % poison:
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
    except dist.DistError:  # best effort: the store may already be gone
        pass


def _poll(store: Store, key: str, seconds: float) -> bool:
    """Whether ``key`` appears in ``store`` within ``seconds`` (polling; no store timeouts,
    which log a warning each)."""
    deadline, pause = time.monotonic() + seconds, 0.005
    while True:
        if store.check([key]):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.25)


def _read(store: Store, key: str) -> str:
    value: bytes = store.get(key)
    return value.decode("utf-8", errors="replace")


def _verdict_or(store: Store, key: str, fallback: str) -> str:
    return _read(store, key) if _poll(store, key, GRACE) else fallback


def _missing(store: Store, prefix: str, members: tuple[int, ...], limit: float) -> str:
    arrived = [r for r in members if store.check([f"{prefix}arrived/{r}"])]
    missing = [r for r in members if r not in arrived]
    who = f"rank {missing[0]} is" if len(missing) == 1 else f"ranks {missing} are"
    return (
        f"pre-flight verification: rank(s) {missing} did not arrive within {limit:g} s "
        f"(ranks {arrived} did); every rank must build the same model with lamina before its "
        f"first collective — check that {who} running and reached distribute()"
    )


def _late(rank: int, limit: float) -> str:
    return (
        f"pre-flight verification: rank {rank} arrived after other ranks stopped waiting "
        f"({limit:g} s); every rank must build the same model with lamina before its first "
        f"collective — check what delayed rank {rank} (or raise {TIMEOUT_ENV})"
    )
