"""What a strategy sees of the job: :class:`StrategyContext`.

A strategy plans and builds from this narrow view (this rank, the mesh, the device and
its kernels, the topology, the backend's declarations), not from the whole session that
:func:`lamina.init` returns: the session's process-group ownership, plugin registry and
control group stay with :func:`lamina.distribute`, which runs pre-flight and the setup
broadcast itself (:mod:`lamina.strategies.wrap_pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lamina.device.backend import Backend
from lamina.device.handle import DeviceHandle
from lamina.device.kernels import KernelLauncher
from lamina.device.mesh import DeviceMesh
from lamina.device.topology import Topology

if TYPE_CHECKING:
    from lamina.session import Runtime


@dataclass(frozen=True)
class StrategyContext:
    """The job as a strategy sees it (see the module docstring)."""

    rank: int
    world_size: int
    mesh: DeviceMesh
    #: The backend's declarations: ``name``, ``device_type``, ``collective_backend``,
    #: ``unsupported_collectives``.
    backend: Backend
    handle: DeviceHandle
    kernels: KernelLauncher
    topology: Topology
    device: torch.device

    @classmethod
    def of(cls, session: Runtime) -> StrategyContext:
        """The context of the job ``session`` joined."""
        return cls(
            session.rank,
            session.world_size,
            session.mesh,
            session.backend,
            session.handle,
            session.kernels,
            session.topology,
            session.device,
        )
