"""Backend "template": the shape of an accelerator backend, run on the host CPU.

Made from lamina's backend TEMPLATE, this is not a device yet. Every method is written
the way a real backend writes it, and its docstring names the vendor call that would go
there (``torch.<vendor>`` stands for the vendor's torch module, e.g. ``torch.xpu``). The
bodies reuse lamina's CPU pieces (:mod:`lamina.backends.cpu`) because on the host the
behaviour is the same.

To turn it into a real backend: set ``priority``/``device_type``/``collective_backend``,
import the vendor module lazily in :meth:`TemplateBackend.availability` and
:meth:`TemplateBackend.handle`, and replace each body with the named call.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager

import torch

from lamina.backends.cpu import CpuEvent, CpuHandle, CpuStream
from lamina.device.backend import Availability, Backend
from lamina.device.handle import DeviceHandle, Event, MemoryStats, Stream
from lamina.device.sysfs import discover_cpu_host
from lamina.device.topology import HostTopology
from lamina.versions import package_version

__all__ = ["BACKEND_NAME", "TEMPLATE_NOTE", "TemplateBackend", "TemplateHandle"]

#: The name ``LAMINA_BACKEND`` selects this backend by.
BACKEND_NAME = "template"

#: Said wherever the backend describes itself, so nobody mistakes it for a device.
TEMPLATE_NOTE = "TEMPLATE backend for plugin authors: runs on the host CPU, not a device"


class TemplateHandle(DeviceHandle):
    """The template DeviceHandle: one method per vendor runtime call, run on the host.

    Memory figures are the host process's (``scope="process"``); streams and events are
    the CPU backend's synchronous queue and host timestamps.
    """

    device_type = "cpu"  # vendor: the torch device type, e.g. "xpu"
    collective_backend = "gloo"  # vendor: its torch.distributed backend, e.g. "xccl"
    visible_devices_env = None  # vendor: e.g. "ZE_AFFINITY_MASK", "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self) -> None:
        # A real handle keeps the vendor module it imported in Backend.handle().
        self._host = CpuHandle()

    # -- devices ---------------------------------------------------------------------
    def device_count(self) -> int:
        """Vendor: ``torch.<vendor>.device_count()``. Here: the one host CPU."""
        return self._host.device_count()

    def current_device(self) -> torch.device:
        """Vendor: ``torch.device(type, torch.<vendor>.current_device())``."""
        return self._host.current_device()

    def set_device(self, device: torch.device | int) -> None:
        """Vendor: ``torch.<vendor>.set_device(index)``; reject another device type."""
        self._host.set_device(device)

    def device_for_local_rank(self, local_rank: int) -> torch.device:
        """Vendor: keep the inherited ``local_rank % device_count()``. Here: ranks share the CPU."""
        return self._host.device_for_local_rank(local_rank)

    # -- memory ------------------------------------------------------------------------
    def memory_stats(self, device: torch.device | None = None) -> MemoryStats:
        """Vendor: ``memory_allocated/memory_reserved/max_memory_allocated``, scope "device"."""
        return self._host.memory_stats(device)

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        """Vendor: ``torch.<vendor>.reset_peak_memory_stats(device)``."""
        self._host.reset_peak_memory(device)

    # -- streams, events, sync -----------------------------------------------------------
    def new_stream(self, device: torch.device | None = None) -> Stream:
        """Vendor: wrap ``torch.<vendor>.Stream(device)`` (no streams: NotSupportedError)."""
        return CpuStream()

    def current_stream(self, device: torch.device | None = None) -> Stream:
        """Vendor: wrap ``torch.<vendor>.current_stream(device)``."""
        return self._host.current_stream(device)

    def use_stream(self, stream: Stream) -> AbstractContextManager[None]:
        """Vendor: ``torch.<vendor>.stream(stream.raw)`` (a context that switches streams)."""
        return self._host.use_stream(stream)

    def new_event(self, enable_timing: bool = True) -> Event:
        """Vendor: wrap ``torch.<vendor>.Event(enable_timing=enable_timing)``."""
        return CpuEvent(enable_timing)

    def synchronize(self, device: torch.device | None = None) -> None:
        """Vendor: ``torch.<vendor>.synchronize(device)``. Here a no-op: host work is done."""
        self._host.synchronize(device)

    # -- RNG and dtypes ------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Vendor: ``torch.<vendor>.manual_seed_all(seed)``."""
        self._host.manual_seed(seed)

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        """Vendor: ``torch.<vendor>.get_rng_state(device)`` (a CPU byte tensor)."""
        return self._host.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        """Vendor: ``torch.<vendor>.set_rng_state(state, device)``."""
        self._host.set_rng_state(state, device)

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """Vendor: ask the runtime (e.g. ``torch.<vendor>.is_bf16_supported()``) per dtype."""
        return self._host.supported_dtypes()


class TemplateBackend(Backend):
    """Backend "template": never chosen by default (priority -10); select it by name."""

    name = BACKEND_NAME
    priority = -10  # a real accelerator uses > 0 so that it wins over "cpu" when present
    device_type = "cpu"
    collective_backend = "gloo"

    def availability(self) -> Availability:
        """Vendor: import the runtime here (not at module import), then count devices."""
        # Step 1, the lazy import. A real backend writes
        #   try: import torch_vendor
        #   except ImportError as exc: return Availability.no(f"... pip install ...: {exc}")
        import torch.distributed as dist

        # Step 2, the devices. A real backend returns Availability.no when the count is 0,
        # naming the driver or the visible-devices variable to check.
        count = TemplateHandle().device_count()
        # Step 3, the collective library the handle names.
        if not dist.is_available() or not dist.is_gloo_available():
            return Availability.no(
                f"this torch build has no gloo support, which backend {BACKEND_NAME!r} uses "
                "for collectives; install a standard torch wheel"
            )
        return Availability.yes(f"{TEMPLATE_NOTE}; {count} device(s), gloo")

    def handle(self) -> DeviceHandle:
        """Vendor: import the runtime and build the handle on it."""
        return TemplateHandle()

    def discover_host_topology(self, local_rank: int, local_world_size: int) -> HostTopology:
        """Vendor: add device links (``LocalLink``) and fast groups to the host's NUMA facts."""
        host = discover_cpu_host(local_rank)
        note = f"{TEMPLATE_NOTE}; no device links to discover"
        return dataclasses.replace(host, notes=(*host.notes, note))

    def vendor_versions(self) -> dict[str, str]:
        """Vendor: the versions of its runtime packages, read from metadata (no import)."""
        return {
            dist: version
            for dist in ("torch", "lamina-backend-template")
            if (version := package_version(dist)) is not None
        }
