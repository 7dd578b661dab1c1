"""torch's device-agnostic API for an accelerator's handle, where the installed torch has it.

``torch.accelerator`` (torch 2.6+; memory figures from 2.9) answers device count and
index, synchronization and the caching allocator's figures for whatever accelerator
torch was built or extended for. :class:`AcceleratorHandle` uses it when it serves the
handle's device type and falls back to the vendor module (``torch.cuda``, ``torch.npu``:
the same functions under their older names) for what an older torch lacks. Streams and
events stay the vendor's classes, which are ``torch.Stream`` / ``torch.Event``
subclasses (:mod:`lamina.device.torch_streams` wraps them).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from lamina.device.handle import DeviceHandle, MemoryStats

__all__ = ["ACCELERATOR_NAMES", "AcceleratorHandle"]

#: ``torch.accelerator`` function -> the vendor module's function of the same job.
ACCELERATOR_NAMES = {
    "device_count": "device_count",
    "current_device_index": "current_device",
    "set_device_index": "set_device",
    "synchronize": "synchronize",
    "memory_allocated": "memory_allocated",
    "memory_reserved": "memory_reserved",
    "max_memory_allocated": "max_memory_allocated",
    "reset_peak_memory_stats": "reset_peak_memory_stats",
}


class AcceleratorHandle(DeviceHandle):
    """Device count, index, synchronization and memory figures through
    ``torch.accelerator`` where it serves :attr:`device_type`, else through
    :meth:`vendor`."""

    @abc.abstractmethod
    def vendor(self) -> Any:
        """The vendor's torch module (``torch.cuda``)."""

    def accelerator(self) -> Any | None:
        """``torch.accelerator`` when this torch has it and it serves this device type."""
        api = getattr(torch, "accelerator", None)
        if api is None or not api.is_available():
            return None
        current = api.current_accelerator()
        return api if current is not None and current.type == self.device_type else None

    def call(self, name: str, *args: Any) -> Any:
        """``torch.accelerator.<name>(*args)``, or the vendor's function of the same job."""
        api = self.accelerator()
        function = getattr(api, name, None) if api is not None else None
        if function is None:
            function = getattr(self.vendor(), ACCELERATOR_NAMES[name])
        return function(*args)

    def device_count(self) -> int:
        return int(self.call("device_count"))

    def current_device(self) -> torch.device:
        return torch.device(self.device_type, int(self.call("current_device_index")))

    def set_device(self, device: torch.device | int) -> None:
        self.call("set_device_index", self._checked(device))

    def synchronize(self, device: torch.device | None = None) -> None:
        self.call("synchronize", self._checked(device))

    def memory_stats(self, device: torch.device | None = None) -> MemoryStats:
        """The caching allocator's figures (``scope="device"``)."""
        d = self._checked(device)
        return MemoryStats(
            allocated=int(self.call("memory_allocated", d)),
            reserved=int(self.call("memory_reserved", d)),
            peak=int(self.call("max_memory_allocated", d)),
            scope="device",
        )

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        self.call("reset_peak_memory_stats", self._checked(device))

    def _checked(self, device: torch.device | int | None) -> torch.device | int | None:
        if isinstance(device, torch.device) and device.type != self.device_type:
            raise ValueError(
                f"the {self.device_type} backend manages {self.device_type!r} devices, "
                f"not {device!r}"
            )
        return device
