"""The Backend contract: what a device plugin registers through ``lamina_register_backends``."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from lamina.device.handle import DeviceHandle
from lamina.device.topology import HostTopology


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run in this process, and why not when it cannot."""

    available: bool
    reason: str = ""

    @classmethod
    def yes(cls, detail: str = "") -> Availability:
        """An available backend; ``detail`` may say what was found (e.g. ``"2 devices"``)."""
        return cls(True, detail)

    @classmethod
    def no(cls, reason: str) -> Availability:
        """An unavailable backend; ``reason`` must say what is missing and how to fix it."""
        if not reason:
            raise ValueError("an unavailable backend must give a reason")
        return cls(False, reason)


class Backend(abc.ABC):
    """One accelerator family: availability, its DeviceHandle, and topology discovery.

    Backends must be cheap to construct and must not import their vendor package at
    construction: :meth:`availability` probes lazily and explains a failure.
    """

    #: Short unique name used by ``LAMINA_BACKEND`` (``"cpu"``, ``"cuda"``, ...).
    name: str

    #: Higher wins when no backend is requested by name; the CPU backend has 0.
    priority: int = 0

    #: torch device type string of the handle (``"cpu"``, ``"cuda"``, ``"xla"``, ``"npu"``).
    device_type: str

    #: torch.distributed backend for collectives (``"gloo"``, ``"nccl"``, ``"xla"``, ``"hccl"``).
    collective_backend: str

    #: ``init_method`` of a multi-rank job's process group (``"xla://"`` lets the XLA
    #: runtime assign ranks; lamina then checks they agree with ``RANK``).
    init_method: str = "env://"

    #: torch.distributed backend for lamina's own object collectives (topology gather,
    #: verification) when the collective backend cannot carry CPU tensors (``"gloo"``
    #: for xla); ``None``: use the default group.
    control_backend: str | None = None

    #: Collective ops the collective backend lacks (``"reduce_scatter"``,
    #: ``"all_gather"``); plans use their declared all-reduce alternatives instead.
    unsupported_collectives: frozenset[str] = frozenset()

    #: Each rank of a host needs a device of its own (its collective library refuses two
    #: ranks on one device); ``lamina.init`` and ``lamina run`` check the count first.
    one_device_per_rank: bool = False

    #: The environment variable that limits which devices a process sees
    #: (``"CUDA_VISIBLE_DEVICES"``); named in the error when ranks outnumber devices.
    visible_devices_env: str = ""

    @abc.abstractmethod
    def availability(self) -> Availability:
        """Probe (without side effects beyond importing the vendor package) whether it runs."""

    @abc.abstractmethod
    def handle(self) -> DeviceHandle:
        """The DeviceHandle; only called when :meth:`availability` said yes."""

    @abc.abstractmethod
    def discover_host_topology(self, local_rank: int, local_world_size: int) -> HostTopology:
        """What this host looks like from this process: devices, NUMA, intra-host links."""

    def prepare_process(
        self, rank: int, world_size: int, local_rank: int, local_world_size: int
    ) -> None:
        """Configure the vendor runtime for this rank before any device is touched.

        Called by ``lamina.init()`` before :meth:`handle`. Default: nothing. Raise
        :class:`lamina.errors.NotSupportedError` when the runtime cannot run this launch.
        """
        return None

    def vendor_versions(self) -> dict[str, str]:
        """Versions of the vendor packages this backend uses (found without importing them)."""
        return {}
