"""The Ascend NPU backend: torch_npu devices, HCCL collectives, CANN topology.

:meth:`NpuBackend.availability` never imports torch_npu blindly: it first looks for the
package (``importlib.util.find_spec``) and for the CANN libraries on disk
(:mod:`lamina_npu.cann`), and imports torch_npu only when both are there.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

from lamina.device.backend import Availability, Backend
from lamina.device.handle import DeviceHandle
from lamina.device.topology import HostTopology
from lamina.versions import package_version
from lamina_npu.cann import probe_cann, torch_npu_installed
from lamina_npu_autoload_guard import AUTOLOAD_ENV, DISABLED_ENV

__all__ = ["NpuBackend"]


def _torch_npu_pin() -> str:
    """The torch_npu release matching this torch (torch_npu follows torch's version)."""
    torch_version = (package_version("torch") or "").split("+", 1)[0]
    return f"torch_npu=={torch_version}" if torch_version else "torch_npu"


def _guard_note() -> str:
    if os.environ.get(DISABLED_ENV):
        return f"; torch_npu autoload disabled at start-up ({AUTOLOAD_ENV}=0)"
    return ""


class NpuBackend(Backend):
    """Huawei Ascend NPUs through torch_npu; collectives over HCCL."""

    name = "npu"
    priority = 80
    device_type = "npu"
    collective_backend = "hccl"
    one_device_per_rank = True
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

    def availability(self) -> Availability:
        """torch_npu installed, CANN libraries findable, torch_npu importable, an NPU visible."""
        if not torch_npu_installed():
            return Availability.no(
                f"torch_npu is not installed: pip install {_torch_npu_pin()} "
                "(it also needs the Ascend CANN toolkit)"
            )
        probe = probe_cann()
        if not probe.usable:
            return Availability.no(probe.reason() + _guard_note())
        autoload = os.environ.get(AUTOLOAD_ENV)
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:
            # torch_npu sets TORCH_DEVICE_BACKEND_AUTOLOAD=0 while importing and only
            # restores it on success: put back what was there for child processes.
            if autoload is None:
                os.environ.pop(AUTOLOAD_ENV, None)
            else:
                os.environ[AUTOLOAD_ENV] = autoload
            first_line = (str(exc).strip().splitlines() or [""])[0]
            return Availability.no(
                f"import torch_npu failed ({type(exc).__name__}: {first_line}): check that "
                f"the CANN toolkit at {probe.toolkit_root or 'the library path'} matches "
                f"torch_npu {package_version('torch_npu')} and that its set_env.sh is sourced"
            )
        from lamina_npu.handle import npu_runtime

        npu = npu_runtime()
        count = int(npu.device_count()) if npu.is_available() else 0
        if count < 1:
            return Availability.no(
                "torch_npu and CANN load, but no NPU is visible: check the driver with "
                "`npu-smi info` and ASCEND_RT_VISIBLE_DEVICES"
            )
        return Availability.yes(
            f"{count} NPU(s), torch_npu {package_version('torch_npu')}, HCCL, "
            f"CANN at {probe.toolkit_root or os.path.dirname(probe.found['libhccl.so'])}"
        )

    def handle(self) -> DeviceHandle:
        from lamina_npu.handle import NpuHandle

        return NpuHandle()

    def discover_host_topology(self, local_rank: int, local_world_size: int) -> HostTopology:
        from lamina_npu.handle import npu_runtime
        from lamina_npu.topology import discover_npu_host

        return discover_npu_host(local_rank, npu_runtime())

    def vendor_versions(self) -> dict[str, str]:
        """torch_npu's version; CANN's too when torch_npu is already imported."""
        versions: dict[str, str] = {}
        torch_npu_version = package_version("torch_npu")
        if torch_npu_version:
            versions["torch_npu"] = torch_npu_version
        module = sys.modules.get("torch_npu")
        if module is not None:
            with contextlib.suppress(Exception):  # older torch_npu, runtime not initialized
                versions["cann"] = str(module.npu.utils.get_cann_version())
        return versions
