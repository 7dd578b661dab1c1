"""The lamina plugin of lamina-backend-npu (entry point ``npu = "lamina_npu.plugin"``).

It registers :class:`~lamina_npu.backend.NpuBackend`. It registers no kernels: the
built-in kernels run their pure-torch references on NPU tensors.
"""

from __future__ import annotations

from lamina.device.backend import Backend
from lamina.hookspecs import hookimpl
from lamina_npu.backend import NpuBackend


@hookimpl
def lamina_register_backends() -> list[Backend]:
    """The Ascend NPU backend."""
    return [NpuBackend()]
