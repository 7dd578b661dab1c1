"""The CUDA backend: availability probe, handle factory, NVML topology discovery."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import cast

from lamina.device.backend import Availability, Backend
from lamina.device.handle import DeviceHandle
from lamina.device.topology import HostTopology
from lamina.versions import package_version

__all__ = ["VENDOR_DISTRIBUTIONS", "CudaBackend", "cuda_unavailable_reason"]

#: Distributions whose versions :meth:`CudaBackend.vendor_versions` reports.
VENDOR_DISTRIBUTIONS: tuple[str, ...] = ("torch", "nvidia-ml-py", "triton")


def _visible_env() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run in this process, or ``None`` when it can."""
    import torch

    if torch.version.cuda is None:
        if getattr(torch.version, "hip", None):
            return (
                f"torch {torch.__version__} is a ROCm build; the cuda backend needs a CUDA "
                "build of torch (pip install torch from the CUDA wheel index)"
            )
        return f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        said = "; ".join(str(w.message).splitlines()[0] for w in caught)
        return (
            f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda}, "
            f"{_visible_env()}{'; ' + said if said else ''}); check the driver with nvidia-smi"
        )
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return (
            f"torch {torch.__version__} has no NCCL support; install a Linux CUDA build of "
            "torch (NCCL ships with it)"
        )
    return None


class CudaBackend(Backend):
    """NVIDIA GPUs through ``torch.cuda``, NCCL collectives, NVML topology."""

    name = "cuda"
    priority = 100
    device_type = "cuda"
    collective_backend = "nccl"
    one_device_per_rank = True
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def availability(self) -> Availability:
        reason = cuda_unavailable_reason()
        if reason is not None:
            return Availability.no(reason)
        import torch

        count = torch.cuda.device_count()
        major, minor = torch.cuda.get_device_capability(0)
        name = torch.cuda.get_device_name(0)
        nccl_version = cast("Callable[[], tuple[int | str, ...]]", torch.cuda.nccl.version)
        nccl = ".".join(str(v) for v in nccl_version())
        return Availability.yes(
            f"{count} CUDA device(s), {name} (sm_{major}{minor}), CUDA {torch.version.cuda}, "
            f"NCCL {nccl}, {_visible_env()}"
        )

    def handle(self) -> DeviceHandle:
        from lamina_cuda.handle import CudaHandle

        return CudaHandle()

    def discover_host_topology(self, local_rank: int, local_world_size: int) -> HostTopology:
        """NVML topology (NVLink, PCIe, NUMA); PCIe-only estimates when NVML is absent."""
        from lamina_cuda.nvml_topology import discover_host_topology

        return discover_host_topology(local_rank, local_world_size)

    def vendor_versions(self) -> dict[str, str]:
        return {
            dist: version
            for dist in VENDOR_DISTRIBUTIONS
            if (version := package_version(dist)) is not None
        }
