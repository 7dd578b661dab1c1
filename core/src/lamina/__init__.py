"""lamina: portable, static-graph distributed training for PyTorch.

The public surface is small: :func:`init` joins the job and returns a :class:`Runtime`;
the device contracts live in :mod:`lamina.device`; plugins implement
:mod:`lamina.hookspecs`.
"""

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
