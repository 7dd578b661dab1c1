"""What NVML says about this host's GPUs, as plain data: queried live or loaded from JSON.

:class:`NvmlAnswers` holds exactly the NVML answers that topology discovery needs (per
GPU: PCI bus id, NUMA node, CPU affinity, PCIe generation/width, NVLink links; per GPU
pair: the PCIe common-ancestor level). :func:`query_nvml` asks the driver through
``nvidia-ml-py`` (import name ``pynvml``); :func:`load_answers` reads a recorded answer
set, so that the topology logic in :mod:`lamina_cuda.nvml_topology` is testable without
a GPU. ``pynvml`` is imported only inside :func:`query_nvml`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lamina.errors import BackendUnavailableError

__all__ = [
    "TOPOLOGY_LEVELS",
    "GpuAnswer",
    "NvLinkAnswer",
    "NvmlAnswers",
    "NvmlUnavailableError",
    "answers_from_dict",
    "answers_to_dict",
    "cpulist_from_masks",
    "level_name",
    "load_answers",
    "normalize_bus_id",
    "query_nvml",
    "save_answers",
]

#: ``nvmlGpuTopologyLevel_t`` names (nvidia-smi spelling in the comment) by value.
TOPOLOGY_LEVELS: dict[str, int] = {
    "INTERNAL": 0,  # same board
    "SINGLE": 10,  # PIX: one PCIe switch
    "MULTIPLE": 20,  # PXB: several PCIe switches, no host bridge
    "HOSTBRIDGE": 30,  # PHB: same host bridge
    "NODE": 40,  # same NUMA node, several host bridges
    "SYSTEM": 50,  # SYS: across NUMA nodes / sockets
}

#: ``nvmlNvLinkDeviceType_t`` values as the names stored in :class:`NvLinkAnswer`.
_REMOTE_TYPES: dict[int, str] = {0: "gpu", 1: "ibmnpu", 2: "switch", 0xFF: "unknown"}

_BUS_ID = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


class NvmlUnavailableError(BackendUnavailableError):
    """NVML cannot be asked here (no nvidia-ml-py, no driver library, driver not loaded)."""


def normalize_bus_id(text: str) -> str:
    """A PCI bus id in one spelling, ``dddd:bb:dd.f`` lower case (NVML writes 8 domain digits)."""
    match = _BUS_ID.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"bad PCI bus id {text!r}; expected DOMAIN:BUS:DEVICE.FUNCTION")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def level_name(level: int) -> str:
    """The name of a common-ancestor level value (``"SYSTEM"`` for 50), or ``"LEVEL<n>"``."""
    for name, value in TOPOLOGY_LEVELS.items():
        if value == level:
            return name
    return f"LEVEL{level}"


@dataclass(frozen=True)
class NvLinkAnswer:
    """One NVLink of a GPU: state, NVML version value, and what is at the other end."""

    link: int
    active: bool
    #: ``nvmlNvlinkVersion_t`` value (6 = NVLink 4.0), ``None`` when not reported.
    version: int | None = None
    remote_bus_id: str | None = None
    #: ``"gpu"``, ``"switch"``, ``"ibmnpu"``, ``"unknown"``, or ``None`` when not reported.
    remote_type: str | None = None


@dataclass(frozen=True)
class GpuAnswer:
    """What NVML reports about one GPU (``index`` is NVML's enumeration order)."""

    index: int
    bus_id: str
    name: str = ""
    uuid: str | None = None
    compute_capability: tuple[int, int] | None = None
    numa_node: int | None = None
    #: CPUs close to the GPU as a CPU list (``"0-51"``), from ``nvmlDeviceGetCpuAffinity``.
    cpu_affinity: str | None = None
    #: Max PCIe generation/width of the GPU's link (falls back to the current values).
    pcie_gen: int | None = None
    pcie_width: int | None = None
    nvlinks: tuple[NvLinkAnswer, ...] = ()


@dataclass(frozen=True)
class NvmlAnswers:
    """NVML's answers for one host: GPUs and the common-ancestor level of every pair."""

    gpus: tuple[GpuAnswer, ...]
    #: ``(i, j)`` with ``i < j`` (NVML indices) -> ``nvmlGpuTopologyLevel_t`` value.
    common_ancestor: dict[tuple[int, int], int] = field(default_factory=dict)
    driver_version: str | None = None
    #: Where the answers came from and what could not be asked.
    notes: tuple[str, ...] = ()

    def level(self, a: int, b: int) -> int | None:
        """The common-ancestor level between NVML GPUs ``a`` and ``b`` (``None``: unknown)."""
        if a == b:
            return TOPOLOGY_LEVELS["INTERNAL"]
        return self.common_ancestor.get((min(a, b), max(a, b)))


# --------------------------------------------------------------------------- JSON


def answers_to_dict(answers: NvmlAnswers) -> dict[str, Any]:
    """Plain JSON-able data; levels are written by name."""
    return {
        "driver_version": answers.driver_version,
        "notes": list(answers.notes),
        "gpus": [asdict(g) for g in answers.gpus],
        "common_ancestor": [
            [a, b, level_name(level)] for (a, b), level in sorted(answers.common_ancestor.items())
        ],
    }


def _level_value(raw: Any, where: str) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.upper() in TOPOLOGY_LEVELS:
        return TOPOLOGY_LEVELS[raw.upper()]
    raise ValueError(f"{where}: level {raw!r} is not one of {', '.join(TOPOLOGY_LEVELS)}")


def _gpu_from_dict(raw: dict[str, Any], where: str) -> GpuAnswer:
    try:
        links = tuple(
            NvLinkAnswer(
                link=int(link["link"]),
                active=bool(link["active"]),
                version=link.get("version"),
                remote_bus_id=(
                    normalize_bus_id(link["remote_bus_id"]) if link.get("remote_bus_id") else None
                ),
                remote_type=link.get("remote_type"),
            )
            for link in raw.get("nvlinks", [])
        )
        cc = raw.get("compute_capability")
        return GpuAnswer(
            index=int(raw["index"]),
            bus_id=normalize_bus_id(raw["bus_id"]),
            name=str(raw.get("name", "")),
            uuid=raw.get("uuid"),
            compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
            numa_node=raw.get("numa_node"),
            cpu_affinity=raw.get("cpu_affinity"),
            pcie_gen=raw.get("pcie_gen"),
            pcie_width=raw.get("pcie_width"),
            nvlinks=links,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from exc


def answers_from_dict(data: dict[str, Any], where: str = "NVML answers") -> NvmlAnswers:
    """Rebuild :class:`NvmlAnswers` from :func:`answers_to_dict` data (levels by name or value)."""
    gpus = tuple(_gpu_from_dict(g, f"{where}: gpus[{k}]") for k, g in enumerate(data["gpus"]))
    levels: dict[tuple[int, int], int] = {}
    for k, entry in enumerate(data.get("common_ancestor", [])):
        a, b, raw = entry
        levels[(min(a, b), max(a, b))] = _level_value(raw, f"{where}: common_ancestor[{k}]")
    return NvmlAnswers(
        gpus=gpus,
        common_ancestor=levels,
        driver_version=data.get("driver_version"),
        notes=tuple(data.get("notes", ())),
    )


def load_answers(path: str | Path) -> NvmlAnswers:
    """Read recorded answers from a JSON file (see :func:`save_answers`)."""
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    return answers_from_dict(data, where=str(path))


def save_answers(answers: NvmlAnswers, path: str | Path) -> None:
    """Write answers as JSON, e.g. to record a machine for a test fixture."""
    Path(path).write_text(json.dumps(answers_to_dict(answers), indent=1) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- live query


def cpulist_from_masks(masks: list[int], bits_per_mask: int = 64) -> str:
    """A CPU list (``"0-3,8"``) from NVML's array of affinity bitmasks, lowest word first."""
    cpus = [
        word * bits_per_mask + bit
        for word, mask in enumerate(masks)
        for bit in range(bits_per_mask)
        if mask >> bit & 1
    ]
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _text(value: Any) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


def _unavailable_reason(pynvml: Any, exc: Exception) -> str:
    hints = (
        (
            "NVMLError_LibraryNotFound",
            "libnvidia-ml.so.1 ships with the NVIDIA driver; "
            "install the driver or run on a GPU host",
        ),
        ("NVMLError_DriverNotLoaded", "the NVIDIA kernel driver is not loaded; check nvidia-smi"),
        (
            "NVMLError_NoPermission",
            "no permission to open the GPU device files; check /dev/nvidia*",
        ),
    )
    for name, hint in hints:
        cls = getattr(pynvml, name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return f"{exc}: {hint}"
    return f"nvmlInit failed: {exc}; check the driver with nvidia-smi"


T = TypeVar("T")


class _Asker:
    """Calls NVML functions, turning 'not supported here' answers into ``None`` plus a note."""

    def __init__(self, pynvml: Any) -> None:
        self.nvml = pynvml
        self.missing: set[str] = set()

    def ask(self, name: str, *args: Any, convert: Callable[[Any], T] = lambda v: v) -> T | None:
        fn = getattr(self.nvml, name, None)
        if fn is None:
            self.missing.add(f"{name} (not in this nvidia-ml-py)")
            return None
        try:
            return convert(fn(*args))
        except self.nvml.NVMLError as exc:
            self.missing.add(f"{name} ({exc})")
            return None


def _query_links(asker: _Asker, handle: Any) -> tuple[NvLinkAnswer, ...]:
    nvml = asker.nvml
    links: list[NvLinkAnswer] = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError:
            continue  # no such link on this GPU, or NVLink not supported at all
        if not state:
            links.append(NvLinkAnswer(link, False))
            continue
        remote = asker.ask("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        kind = asker.ask("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        links.append(
            NvLinkAnswer(
                link=link,
                active=True,
                version=asker.ask("nvmlDeviceGetNvLinkVersion", handle, link, convert=int),
                remote_bus_id=normalize_bus_id(_text(remote.busId)) if remote is not None else None,
                remote_type=_REMOTE_TYPES.get(int(kind), "unknown") if kind is not None else None,
            )
        )
    return tuple(links)


def _query_gpu(asker: _Asker, index: int, handle: Any) -> GpuAnswer:
    pci = asker.nvml.nvmlDeviceGetPciInfo(handle)
    words = max(1, -(-(os.cpu_count() or 1) // 64))
    affinity = asker.ask(
        "nvmlDeviceGetCpuAffinity", handle, words, convert=lambda a: cpulist_from_masks(list(a))
    )
    cc = asker.ask("nvmlDeviceGetCudaComputeCapability", handle)
    gen = asker.ask("nvmlDeviceGetMaxPcieLinkGeneration", handle, convert=int)
    width = asker.ask("nvmlDeviceGetMaxPcieLinkWidth", handle, convert=int)
    if gen is None:
        gen = asker.ask("nvmlDeviceGetCurrPcieLinkGeneration", handle, convert=int)
    if width is None:
        width = asker.ask("nvmlDeviceGetCurrPcieLinkWidth", handle, convert=int)
    return GpuAnswer(
        index=index,
        bus_id=normalize_bus_id(_text(pci.busId)),
        name=_text(asker.ask("nvmlDeviceGetName", handle) or ""),
        uuid=asker.ask("nvmlDeviceGetUUID", handle, convert=_text),
        compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
        numa_node=asker.ask("nvmlDeviceGetNumaNodeId", handle, convert=int),
        cpu_affinity=affinity or None,
        pcie_gen=gen,
        pcie_width=width,
        nvlinks=_query_links(asker, handle),
    )


def query_nvml() -> NvmlAnswers:
    """Ask the NVIDIA driver through ``nvidia-ml-py``; :class:`NvmlUnavailableError` if it can't.

    Queries that a GPU or driver does not support are left ``None`` and listed in ``notes``.
    """
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailableError(
            f"nvidia-ml-py is not installed ({exc}); pip install nvidia-ml-py"
        ) from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailableError(_unavailable_reason(pynvml, exc)) from exc
    try:
        asker = _Asker(pynvml)
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        gpus = tuple(_query_gpu(asker, i, h) for i, h in enumerate(handles))
        levels: dict[tuple[int, int], int] = {}
        for a in range(len(handles)):
            for b in range(a + 1, len(handles)):
                level = asker.ask(
                    "nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b], convert=int
                )
                if level is not None:
                    levels[(a, b)] = level
        driver = asker.ask("nvmlSystemGetDriverVersion", convert=_text)
    except pynvml.NVMLError as exc:
        raise NvmlUnavailableError(f"NVML query failed: {exc}; check nvidia-smi") from exc
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    notes = [f"NVML driver {driver}: {len(gpus)} GPU(s)"]
    notes.extend(f"NVML could not answer {m}" for m in sorted(asker.missing))
    return NvmlAnswers(gpus, levels, driver, tuple(notes))
