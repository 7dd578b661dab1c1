"""lamina: portable, static-graph distributed training for PyTorch.

The public surface is small: :func:`init` joins the job and returns a :class:`Runtime`;
the device contracts live in :mod:`lamina.device`; plugins implement
:mod:`lamina.hookspecs`.

Names load on first use (PEP 562), so ``import lamina.cli.main`` or
``import lamina.errors`` does not import torch: a ``lamina`` command that needs no
tensors (``emulate``, ``trace``, ``checkpoint ls``, the launchers) starts in a fraction of
torch's import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lamina.api import compile_step, distribute, loss_parallel
    from lamina.device.backend import Availability, Backend
    from lamina.device.handle import DeviceHandle, Event, MemoryStats, Stream
    from lamina.device.kernels import Dim3, KernelLauncher
    from lamina.device.mesh import DeviceMesh
    from lamina.device.topology import Topology
    from lamina.errors import LaminaError
    from lamina.hookspecs import hookimpl
    from lamina.session import Runtime, current, init, shutdown
    from lamina.strategies.contract import Placement

__version__ = "0.1.0"

#: Each public name and the module that defines it.
_HOME = {
    "compile_step": "lamina.api",
    "distribute": "lamina.api",
    "loss_parallel": "lamina.api",
    "Availability": "lamina.device.backend",
    "Backend": "lamina.device.backend",
    "DeviceHandle": "lamina.device.handle",
    "Event": "lamina.device.handle",
    "MemoryStats": "lamina.device.handle",
    "Stream": "lamina.device.handle",
    "Dim3": "lamina.device.kernels",
    "KernelLauncher": "lamina.device.kernels",
    "DeviceMesh": "lamina.device.mesh",
    "Topology": "lamina.device.topology",
    "LaminaError": "lamina.errors",
    "hookimpl": "lamina.hookspecs",
    "Runtime": "lamina.session",
    "current": "lamina.session",
    "init": "lamina.session",
    "shutdown": "lamina.session",
    "Placement": "lamina.strategies.contract",
}

__all__ = [
    "Availability",
    "Backend",
    "DeviceHandle",
    "DeviceMesh",
    "Dim3",
    "Event",
    "KernelLauncher",
    "LaminaError",
    "MemoryStats",
    "Placement",
    "Runtime",
    "Stream",
    "Topology",
    "__version__",
    "compile_step",
    "current",
    "distribute",
    "hookimpl",
    "init",
    "loss_parallel",
    "shutdown",
]


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first use, and keep the name here."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'lamina' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
