"""lamina: portable, static-graph distributed training for PyTorch.

The public surface is small: :func:`init` joins the job and returns a :class:`Runtime`;
:func:`distribute` wraps a model with a strategy or a composition; what a training loop
also needs (:class:`CheckpointManager`, :func:`seed_all`, :class:`EpochSampler`, the
gradient codecs, every error lamina raises) is importable from here too. Backend authors
find the device contracts in :mod:`lamina.device`; plugins implement
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
    from lamina.checkpoint import CheckpointManager, seed_all
    from lamina.comm.codecs import CastCodec, Codec, Fp8Codec, TwoPhaseCodec
    from lamina.data import EpochSampler
    from lamina.device.backend import Availability, Backend
    from lamina.device.handle import DeviceHandle, Event, MemoryStats, Stream
    from lamina.device.kernels import Dim3, KernelLauncher
    from lamina.device.mesh import DeviceMesh
    from lamina.device.topology import Topology
    from lamina.errors import (
        BackendNotFoundError,
        BackendUnavailableError,
        ConfigError,
        KernelError,
        LaminaError,
        MeshError,
        NotSupportedError,
        TopologyError,
        VerificationError,
    )
    from lamina.hookspecs import hookimpl
    from lamina.session import Runtime, current, init, shutdown
    from lamina.strategies.codec_registry import codecs
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
    "CheckpointManager": "lamina.checkpoint",
    "seed_all": "lamina.checkpoint",
    "Codec": "lamina.comm.codecs",
    "CastCodec": "lamina.comm.codecs",
    "TwoPhaseCodec": "lamina.comm.codecs",
    "Fp8Codec": "lamina.comm.codecs",
    "codecs": "lamina.strategies.codec_registry",
    "EpochSampler": "lamina.data",
    "LaminaError": "lamina.errors",
    "ConfigError": "lamina.errors",
    "BackendNotFoundError": "lamina.errors",
    "BackendUnavailableError": "lamina.errors",
    "NotSupportedError": "lamina.errors",
    "TopologyError": "lamina.errors",
    "MeshError": "lamina.errors",
    "KernelError": "lamina.errors",
    "VerificationError": "lamina.errors",
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
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CastCodec",
    "CheckpointManager",
    "Codec",
    "ConfigError",
    "DeviceHandle",
    "DeviceMesh",
    "Dim3",
    "EpochSampler",
    "Event",
    "Fp8Codec",
    "KernelError",
    "KernelLauncher",
    "LaminaError",
    "MemoryStats",
    "MeshError",
    "NotSupportedError",
    "Placement",
    "Runtime",
    "Stream",
    "Topology",
    "TopologyError",
    "TwoPhaseCodec",
    "VerificationError",
    "__version__",
    "codecs",
    "compile_step",
    "current",
    "distribute",
    "hookimpl",
    "init",
    "loss_parallel",
    "seed_all",
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
