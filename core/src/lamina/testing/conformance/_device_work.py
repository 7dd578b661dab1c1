"""Device work of known size for the event and stream checks, and their assertions."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lamina.device.handle import DeviceHandle, MemoryStats, Stream

# --------------------------------------------------------------------------- device work

#: Bytes the memory checks allocate (float32 ones: every page is written).
MEMORY_BLOCK_BYTES = 64 * 2**20
#: Seconds of work the event and stream checks time or race against.
WORK_SECONDS = 0.05
_MAX_REPEATS = 1 << 14


@dataclass
class _Work:
    """A known amount of device work: ``repeats`` products with a permutation matrix.

    Each product is a full dense matmul on the device, but its result is known exactly on
    the host (a permutation of small integers, exact in every float format), so a check
    needs nothing from the device under test to know what a finished run wrote.
    """

    perm: torch.Tensor  # on the host
    start: torch.Tensor  # on the host
    matrix: torch.Tensor  # on the device: the identity with rows permuted by ``perm``
    initial: torch.Tensor  # ``start`` on the device
    repeats: int = 1

    def run(self, units: int = 1) -> torch.Tensor:
        """Queue ``units`` times the calibrated work on the current stream; the result."""
        x = self.initial
        for _ in range(self.repeats * units):
            x = self.matrix @ x
        return x

    def expected(self, units: int = 1) -> torch.Tensor:
        """What :meth:`run` returns, computed on the host: ``(I[perm])^k @ start``."""
        index = torch.arange(self.perm.numel())
        for _ in range(self.repeats * units):
            index = index[self.perm]
        return self.start[index]


def calibrated_work(handle: DeviceHandle, device: torch.device) -> _Work:
    """Work that takes at least :data:`WORK_SECONDS` on ``device`` by the host clock."""
    n = 512 if device.type == "cpu" else 2048  # few, long kernels: each outlasts its launch
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(n, generator=gen)
    start = torch.randint(1, 100, (n, n), generator=gen).to(torch.float32)
    work = _Work(perm, start, torch.eye(n)[perm].to(device), start.to(device))
    work.run()
    handle.synchronize(device)  # warm-up: library initialisation is not work
    while True:
        started = time.perf_counter()
        work.run()
        handle.synchronize(device)
        took = time.perf_counter() - started
        if took >= WORK_SECONDS or work.repeats >= _MAX_REPEATS:
            return work
        grow = math.ceil(work.repeats * 1.2 * WORK_SECONDS / max(took, 1e-6))
        work.repeats = min(_MAX_REPEATS, max(2 * work.repeats, grow))


def assert_ordered(
    handle: DeviceHandle,
    device: torch.device,
    work: _Work,
    producer: Stream,
    consumer: Stream,
    wait: Callable[[], None],
    what: str,
) -> None:
    """A long write queued on ``producer``, ``wait()``, then a read on ``consumer``.

    The read must see the finished write: with a no-op wait it runs while the producer
    is still busy and sees the zeros the buffer held before.
    """
    out = torch.zeros(work.start.shape, device=device)
    handle.synchronize(device)
    with handle.use_stream(producer):
        out.copy_(work.run())
    wait()
    with handle.use_stream(consumer):
        seen = out.clone()
    handle.synchronize(device)
    _assert_saw_write(seen.cpu(), work.expected(), what)


def assert_synchronized(
    handle: DeviceHandle,
    device: torch.device,
    work: _Work,
    stream: Stream,
    sync: Callable[[], None],
    what: str,
) -> None:
    """A long write queued on ``stream``, ``sync()``, then a read on the current stream."""
    out = torch.zeros(work.start.shape, device=device)
    handle.synchronize(device)
    with handle.use_stream(stream):
        out.copy_(work.run())
    sync()
    seen = out.clone().cpu()
    handle.synchronize(device)
    _assert_saw_write(seen, work.expected(), what)


def _assert_saw_write(seen: torch.Tensor, written: torch.Tensor, what: str) -> None:
    differ = int((seen != written).sum().item())
    assert differ == 0, (
        f"{what} did not order the work: a read after it saw {differ} of {written.numel()} "
        f"elements differ from the long write queued before it (zeros seen: "
        f"{int((seen == 0).sum().item())})"
    )


def bytes_needed(scope: str) -> float:
    """Bytes a 64 MiB block must show: all of it on a device, ~all of it in the RSS."""
    return MEMORY_BLOCK_BYTES * (1.0 if scope == "device" else 0.9)


def figure_delta(low: MemoryStats, high: MemoryStats, figure: str) -> int:
    a, b = getattr(low, figure), getattr(high, figure)
    assert a is not None and b is not None, f"memory_stats().{figure} became None"
    return int(b) - int(a)
