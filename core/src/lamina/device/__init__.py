"""Layer 5, the device layer: the contracts a backend implements.

A backend package (``lamina.backends.cpu``, ``lamina_cuda``, a plugin) subclasses
:class:`Backend` and :class:`DeviceHandle` (most through :class:`AcceleratorHandle`, which
maps the contract onto ``torch.accelerator``), describes its devices as a
:class:`Topology` and runs kernels through a :class:`KernelLauncher`. The names load on
first use (PEP 562); importing them from their modules (``lamina.device.handle``) keeps
working.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lamina.device.accelerator import AcceleratorHandle
    from lamina.device.backend import Availability, Backend
    from lamina.device.handle import CapturedStep, DeviceHandle, Event, MemoryStats, Stream
    from lamina.device.kernels import Dim3, KernelLauncher
    from lamina.device.mesh import DeviceMesh
    from lamina.device.topology import (
        DeviceInfo,
        FastDomain,
        HostTopology,
        Link,
        LinkProfile,
        LocalLink,
        Topology,
    )
    from lamina.device.topology_file import load_topology, save_topology

#: Each public name and the module that defines it.
_HOME = {
    "AcceleratorHandle": "lamina.device.accelerator",
    "Availability": "lamina.device.backend",
    "Backend": "lamina.device.backend",
    "CapturedStep": "lamina.device.handle",
    "DeviceHandle": "lamina.device.handle",
    "Event": "lamina.device.handle",
    "MemoryStats": "lamina.device.handle",
    "Stream": "lamina.device.handle",
    "Dim3": "lamina.device.kernels",
    "KernelLauncher": "lamina.device.kernels",
    "DeviceMesh": "lamina.device.mesh",
    "DeviceInfo": "lamina.device.topology",
    "FastDomain": "lamina.device.topology",
    "HostTopology": "lamina.device.topology",
    "Link": "lamina.device.topology",
    "LinkProfile": "lamina.device.topology",
    "LocalLink": "lamina.device.topology",
    "Topology": "lamina.device.topology",
    "load_topology": "lamina.device.topology_file",
    "save_topology": "lamina.device.topology_file",
}

__all__ = [
    "AcceleratorHandle",
    "Availability",
    "Backend",
    "CapturedStep",
    "DeviceHandle",
    "DeviceInfo",
    "DeviceMesh",
    "Dim3",
    "Event",
    "FastDomain",
    "HostTopology",
    "KernelLauncher",
    "Link",
    "LinkProfile",
    "LocalLink",
    "MemoryStats",
    "Stream",
    "Topology",
    "load_topology",
    "save_topology",
]


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first use, and keep the name here."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'lamina.device' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
