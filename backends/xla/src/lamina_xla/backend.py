"""XlaBackend: torch_xla on a PJRT device (TPU; the host CPU for testing), 'xla' collectives."""

from __future__ import annotations

from lamina.device.backend import Availability, Backend
from lamina.device.handle import DeviceHandle
from lamina.device.sysfs import discover_cpu_host
from lamina.device.topology import HostTopology
from lamina.errors import NotSupportedError
from lamina.versions import package_version
from lamina_xla import probe
from lamina_xla.handle import XlaHandle
from lamina_xla.topology import xla_host_topology


class XlaBackend(Backend):
    """XLA devices through torch_xla's PJRT runtime; collectives on the ``xla`` process group.

    Ranks own one XLA device each. ``availability`` never starts the PJRT runtime (a
    multi-process TPU job must configure it per process first); the handle starts it.
    """

    name = "xla"
    priority = 90
    device_type = "xla"
    collective_backend = "xla"
    #: torch_xla's rendezvous: the PJRT runtime assigns ranks (replica ordinals), so the
    #: process group's rank order is the order XLA collectives use.
    init_method = "xla://"
    #: The ``xla`` process group takes XLA tensors only; object collectives need gloo.
    control_backend = "gloo"

    def availability(self) -> Availability:
        """Check torch_xla, its torch pairing and the PJRT device type, in that order."""
        torch_version = package_version("torch")
        if not probe.find_torch_xla():
            return Availability.no(probe.missing_reason(torch_version))
        xla_version = package_version("torch_xla")
        mismatch = probe.version_mismatch(torch_version, xla_version)
        if mismatch is not None:
            return Availability.no(mismatch)
        try:
            choice = probe.pjrt_choice()
        except ImportError as exc:
            return Availability.no(
                f"torch_xla {xla_version} failed to import ({exc}); reinstall torch=="
                f"{probe.release_text(xla_version or '')} and torch_xla=={xla_version}"
            )
        refused = probe.unset_reason(choice)
        if refused is not None:
            return Availability.no(refused)
        kind = choice.device_type or ""
        how = "set" if choice.explicit else "chosen by torch_xla"
        if kind == "TPU":
            missing = probe.tpu_reason()
            if missing is not None:
                return Availability.no(missing)
            return Availability.yes(
                f"torch_xla {xla_version}, PJRT_DEVICE=TPU ({how}), "
                f"{probe.tpu_chip_count()} TPU chip(s) on PCI"
            )
        if kind == "CPU":
            return Availability.yes(
                f"torch_xla {xla_version}, PJRT_DEVICE=CPU: XLA on the host CPU for testing, "
                "one process (torch_xla has no cross-process CPU collectives)"
            )
        return Availability.yes(
            f"torch_xla {xla_version}, PJRT_DEVICE={kind} ({how}); devices are counted when "
            "the runtime starts"
        )

    def prepare_process(
        self, rank: int, world_size: int, local_rank: int, local_world_size: int
    ) -> None:
        """Configure PJRT for this process's chips before the runtime starts.

        A multi-rank job runs torch_xla's own multi-process set-up (what ``xla://`` does
        under torchrun, done here because lamina touches the device before the process
        group exists). PJRT CPU has no cross-process collectives in torch_xla 2.9, so
        more than one rank on it raises :class:`NotSupportedError`.
        """
        if world_size < 2:
            return
        import torch_xla.runtime as xr
        from torch_xla._internal import pjrt

        kind = xr.device_type()
        if kind == "CPU":
            raise NotSupportedError(
                f"PJRT_DEVICE=CPU runs XLA in one process only (torch_xla has no "
                f"cross-process CPU collectives; each of the {world_size} ranks would be a "
                "world of its own); run 1 process, or use PJRT_DEVICE=TPU"
            )
        pjrt.initialize_multiprocess(local_rank, local_world_size)

    def handle(self) -> DeviceHandle:
        """The XlaHandle; also registers torch_xla's ``xla`` process-group backend."""
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers 'xla' and 'xla://')
        import torch_xla.runtime as xr

        return XlaHandle(xr.device_type())

    def discover_host_topology(self, local_rank: int, local_world_size: int) -> HostTopology:
        """The host as the CPU backend sees it, with this rank's XLA device and ICI links."""
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        device = torch_xla.device()
        index = 0 if device.index is None else device.index
        return xla_host_topology(
            discover_cpu_host(local_rank),
            pjrt_device_type=xr.device_type() or "unknown",
            device_kind=xm.xla_device_kind(device),
            local=[str(n) for n in torch_xla.real_devices()],
            own_index=index,
            first_index=xr.local_ordinal() - index,
            attributes=xr.global_runtime_device_attributes(),
        )

    def vendor_versions(self) -> dict[str, str]:
        """torch_xla and libtpu versions, from package metadata (nothing imported)."""
        return {
            name: version
            for name in ("torch_xla", "libtpu")
            if (version := package_version(name)) is not None
        }
