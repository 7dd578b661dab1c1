"""The CPU reference backend: host memory, gloo collectives, sysfs topology.

It works on every machine and is the embedded default. It is honest about what a CPU
is: work runs synchronously on the host, so streams are ordered trivially and
``synchronize`` has nothing to wait for; events carry host timestamps; memory figures
are process-level (resident set size and its high-water mark), labelled ``"process"``.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from contextlib import AbstractContextManager, nullcontext

import torch

from lamina.device.backend import Availability, Backend
from lamina.device.handle import (
    REDUCED_PRECISION_DTYPES,
    DeviceHandle,
    Event,
    MemoryStats,
    Stream,
    torch_dtypes_by_name,
)
from lamina.device.kernels import KernelRegistry
from lamina.device.sysfs import discover_cpu_host
from lamina.device.topology import HostTopology
from lamina.errors import NotSupportedError
from lamina.hookspecs import hookimpl

_CPU = torch.device("cpu")


class CpuEvent(Event):
    """A host timestamp taken when the event is recorded."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.enable_timing = enable_timing
        self._stamp_ns: int | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._stamp_ns = time.perf_counter_ns()

    def wait(self, stream: Stream | None = None) -> None:
        """Nothing to wait for: CPU work before the record has already run."""

    def synchronize(self) -> None:
        """Nothing to wait for: CPU work before the record has already run."""

    def query(self) -> bool:
        return self._stamp_ns is not None

    def elapsed_time(self, end: Event) -> float:
        if not isinstance(end, CpuEvent):
            raise TypeError(f"elapsed_time needs a CpuEvent, got {type(end).__name__}")
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("elapsed_time needs events created with enable_timing=True")
        if self._stamp_ns is None or end._stamp_ns is None:
            raise RuntimeError("elapsed_time needs both events recorded; call record() first")
        return (end._stamp_ns - self._stamp_ns) / 1e6


class CpuStream(Stream):
    """The host's single, synchronous work queue."""

    def synchronize(self) -> None:
        """Nothing queued: CPU work has run by the time it returns."""

    def query(self) -> bool:
        return True

    def wait_event(self, event: Event) -> None:
        """Ordering holds already: the event's work ran before this call."""

    def wait_stream(self, other: Stream) -> None:
        """Ordering holds already: CPU streams do not run concurrently."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event or CpuEvent()
        event.record(self)
        return event


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class CpuHandle(DeviceHandle):
    """DeviceHandle for the host CPU: one device, process-level memory figures."""

    device_type = "cpu"
    collective_backend = "gloo"
    visible_devices_env = None

    def __init__(self) -> None:
        self._stream = CpuStream()

    def device_count(self) -> int:
        return 1

    def current_device(self) -> torch.device:
        return _CPU

    def set_device(self, device: torch.device | int) -> None:
        index = device if isinstance(device, int) else device.index
        kind = "cpu" if isinstance(device, int) else device.type
        if kind != "cpu" or index not in (None, 0):
            raise ValueError(f"the cpu backend has one device 'cpu', not {device!r}")

    def device_for_local_rank(self, local_rank: int) -> torch.device:
        """Every local rank shares the host CPU."""
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {local_rank}")
        return _CPU

    def memory_stats(self, device: torch.device | None = None) -> MemoryStats:
        rss_kib = _proc_status_kib("VmRSS")
        peak_kib = _proc_status_kib("VmHWM")
        if peak_kib is None:  # not Linux: getrusage gives the peak (KiB on Linux, B on macOS)
            scale = 1 if sys.platform == "darwin" else 1024
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
            return MemoryStats(None, None, peak, "process")
        rss = rss_kib * 1024 if rss_kib is not None else None
        return MemoryStats(rss, rss, peak_kib * 1024, "process")

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        """Reset the kernel's resident-set high-water mark (Linux ``clear_refs`` value 5).

        Where the system has no such control (not Linux, or ``/proc`` read-only) the
        capability does not exist: :class:`NotSupportedError`, as the contract asks.
        """
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")
        except OSError as exc:
            raise NotSupportedError(
                f"cannot reset peak RSS on this system ({exc}); compare against a baseline"
            ) from exc

    def new_stream(self, device: torch.device | None = None) -> Stream:
        return CpuStream()

    def current_stream(self, device: torch.device | None = None) -> Stream:
        return self._stream

    def use_stream(self, stream: Stream) -> AbstractContextManager[None]:
        """Nothing to switch: host work runs in the order it is issued."""
        if not isinstance(stream, CpuStream):
            raise TypeError(f"the cpu backend needs a CpuStream, got {type(stream).__name__}")
        return nullcontext()

    def new_event(self, enable_timing: bool = True) -> Event:
        return CpuEvent(enable_timing)

    def synchronize(self, device: torch.device | None = None) -> None:
        """No-op by definition: CPU work is complete when the call that queued it returns."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        torch.set_rng_state(state)

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """bf16, fp16 and the fp8 formats this torch build can store and convert on CPU."""
        return torch_dtypes_by_name(REDUCED_PRECISION_DTYPES)


class CpuBackend(Backend):
    """The embedded default backend: host CPU with gloo collectives."""

    name = "cpu"
    priority = 0
    device_type = "cpu"
    collective_backend = "gloo"

    def availability(self) -> Availability:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            return Availability.no(
                "this torch build has no gloo support; install a standard torch wheel"
            )
        return Availability.yes(f"{os.cpu_count()} CPU core(s), gloo")

    def handle(self) -> DeviceHandle:
        return CpuHandle()

    def discover_host_topology(self, local_rank: int, local_world_size: int) -> HostTopology:
        return discover_cpu_host(local_rank)


@hookimpl
def lamina_register_backends() -> list[Backend]:
    """The CPU backend."""
    return [CpuBackend()]


@hookimpl
def lamina_register_kernels(registry: KernelRegistry) -> None:
    """CPU implementations of the built-in kernels."""
    from lamina.backends.cpu_kernels import register_cpu_kernels

    register_cpu_kernels(registry)
