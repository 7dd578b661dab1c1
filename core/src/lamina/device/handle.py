"""The DeviceHandle contract: one accelerator family, seen through one small interface.

A backend implements :class:`DeviceHandle` (plus :class:`Stream` and :class:`Event`) on
top of its vendor runtime (``torch.cuda``, ``torch_xla``, ``torch.npu``, plain CPU).
Everything above the device layer talks to devices only through this contract.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lamina.errors import NotSupportedError

#: Where a memory figure comes from: the device allocator, or the whole host process.
MemoryScope = Literal["device", "process"]


@dataclass(frozen=True)
class MemoryStats:
    """Memory figures in bytes for one device.

    ``scope`` says what they measure: ``"device"`` is the backend's caching allocator
    (allocated = live tensors, reserved = held by the allocator); ``"process"`` is the
    host process as the OS sees it (allocated = reserved = resident set size, peak =
    high-water mark of the resident set). ``None`` means the runtime does not report it.
    """

    allocated: int | None
    reserved: int | None
    peak: int | None
    scope: MemoryScope


class Event(abc.ABC):
    """A marker in a stream's work queue that can be waited on and timed."""

    @abc.abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Place the event on ``stream`` (default: the current stream)."""

    @abc.abstractmethod
    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait until the event has completed."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event has completed."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when all work recorded before the event has completed."""

    @abc.abstractmethod
    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end``; both must have been recorded."""


class Stream(abc.ABC):
    """An ordered queue of device work."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work queued on the stream has completed."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when all work queued on the stream has completed."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Queue a wait on ``event`` before any work submitted later to this stream."""

    @abc.abstractmethod
    def wait_stream(self, other: Stream) -> None:
        """Queue a wait for everything already submitted to ``other``."""

    @abc.abstractmethod
    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new timing event) on this stream and return it."""


#: Names of the reduced-precision dtypes a handle may report as supported.
REDUCED_PRECISION_DTYPES: tuple[str, ...] = (
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
)


class CapturedStep(abc.ABC):
    """A step captured once on the device (its kernels, on fixed memory) and replayed.

    The step's inputs are the tensors it read while captured: copy new values into them,
    then :meth:`replay`; :attr:`outputs` are the tensors it wrote, refreshed by each replay
    (read them after the device synchronizes, or on its stream).
    """

    #: What the captured call returned (its tensors are rewritten by every replay).
    outputs: Any

    @abc.abstractmethod
    def replay(self) -> None:
        """Run the captured work again, queued on the current stream."""


class DeviceHandle(abc.ABC):
    """One accelerator family on this host: devices, memory, streams, sync and RNG.

    Implementations build on the vendor runtime and never re-implement what it gives.
    Where a capability does not exist on the device (e.g. streams on XLA), the
    implementation raises :class:`lamina.errors.NotSupportedError` with the reason.
    """

    #: torch device type string, e.g. ``"cpu"``, ``"cuda"``, ``"xla"``, ``"npu"``.
    device_type: str

    #: torch.distributed backend used for collectives, e.g. ``"gloo"`` or ``"nccl"``.
    collective_backend: str

    #: Environment variable that restricts visible devices (``None`` if there is none).
    visible_devices_env: str | None

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices of this type visible to the process."""

    @abc.abstractmethod
    def current_device(self) -> torch.device:
        """The device new tensors go to by default."""

    @abc.abstractmethod
    def set_device(self, device: torch.device | int) -> None:
        """Make ``device`` the current device of this process."""

    def device_for_local_rank(self, local_rank: int) -> torch.device:
        """The device a process with ``local_rank`` on its host should use."""
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {local_rank}")
        count = self.device_count()
        if count < 1:
            raise RuntimeError(f"no {self.device_type} device is visible to this process")
        return torch.device(self.device_type, local_rank % count)

    @abc.abstractmethod
    def memory_stats(self, device: torch.device | None = None) -> MemoryStats:
        """Current memory figures for ``device`` (default: current device)."""

    @abc.abstractmethod
    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        """Start a new peak-memory measurement window."""

    @abc.abstractmethod
    def new_stream(self, device: torch.device | None = None) -> Stream:
        """Create a new stream on ``device``."""

    @abc.abstractmethod
    def current_stream(self, device: torch.device | None = None) -> Stream:
        """The stream work is currently submitted to."""

    @abc.abstractmethod
    def use_stream(self, stream: Stream) -> AbstractContextManager[None]:
        """Context in which work (kernels, collectives) is queued on ``stream``."""

    @abc.abstractmethod
    def new_event(self, enable_timing: bool = True) -> Event:
        """Create an event; ``enable_timing`` allows :meth:`Event.elapsed_time`."""

    @abc.abstractmethod
    def synchronize(self, device: torch.device | None = None) -> None:
        """Block the host until all queued work on ``device`` has completed."""

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the device random generators of this process."""

    @abc.abstractmethod
    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        """Snapshot of the device RNG state (a CPU byte tensor)."""

    @abc.abstractmethod
    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        """Restore a snapshot taken by :meth:`get_rng_state`."""

    @abc.abstractmethod
    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """Reduced-precision dtypes (bf16, fp16, fp8 variants) the device computes with."""

    def supports(self, dtype: torch.dtype) -> bool:
        """True when ``dtype`` is fp32/fp64 or listed by :meth:`supported_dtypes`."""
        return dtype in (torch.float32, torch.float64) or dtype in self.supported_dtypes()

    # -- optional: graph capture of a step ------------------------------------------------
    def graph_capture_reason(self) -> str:
        """'' when :meth:`capture_step` works here; else why not, in one line (what
        ``lamina info`` shows and what a compiled step records when it launches kernel by
        kernel)."""
        return f"{self.device_type} has no graph capture of a step; its kernels launch one by one"

    def capture_step(self, step: Callable[[], Any], warmup: int = 2) -> CapturedStep:
        """Capture ``step()`` (after ``warmup`` plain calls, on a side stream where the
        device wants them) for :meth:`CapturedStep.replay`; the capture itself runs it
        once more. Optional: ``NotSupportedError`` with :meth:`graph_capture_reason`."""
        raise NotSupportedError(self.graph_capture_reason())


def torch_dtypes_by_name(names: tuple[str, ...]) -> frozenset[torch.dtype]:
    """The torch dtypes among ``names`` that this torch build defines."""
    found = (getattr(torch, name, None) for name in names)
    return frozenset(d for d in found if isinstance(d, torch.dtype))
