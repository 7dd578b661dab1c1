"""Turn NVML's answers into a :class:`~lamina.device.topology.HostTopology`.

The logic is pure: :func:`host_topology_from_answers` takes :class:`NvmlAnswers` (queried
live or recorded) plus which GPUs this process's CUDA runtime sees, and returns links
between CUDA device indices with bandwidth estimates and the fast groups:

* **NVLink** pairs: links joining the two GPUs directly, plus, through an NVSwitch fabric,
  the smaller of the two GPUs' switch-link counts, times a per-link figure chosen by
  NVLink version (else by compute capability). Source ``"discovered"``.
* **PCIe** pairs up to the same NUMA node (``INTERNAL`` .. ``NODE``): the slower of the
  two GPUs' links, scaled from PCIe Gen3 x16 by generation and width. Source ``"discovered"``.
* Pairs across sockets (``SYSTEM``) or of unknown level: traffic is staged through host
  memory; the core's shared-memory estimate. Source ``"estimated"``.

Fast groups are NVLink islands (an NVSwitch joins all its GPUs); GPUs without NVLink
are grouped by peer-to-peer PCIe reach (same socket).

Every figure is GB/s per direction. The per-link NVLink and PCIe figures are the ones
NCCL uses internally; latencies are order-of-magnitude estimates.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace

from lamina.device.sysfs import numa_node_of_cpus, parse_cpulist, read_numa_nodes
from lamina.device.topology import (
    DEFAULT_SHM_LINK,
    HostTopology,
    LinkProfile,
    LinkSource,
    LocalLink,
)
from lamina_cuda.nvml_source import (
    TOPOLOGY_LEVELS,
    GpuAnswer,
    NvmlAnswers,
    NvmlUnavailableError,
    normalize_bus_id,
    query_nvml,
)

__all__ = [
    "NVLINK_GBPS_BY_SM_MAJOR",
    "NVLINK_GBPS_BY_VERSION",
    "PCIE_GEN3_X16_GBPS",
    "CudaDeviceId",
    "discover_host_topology",
    "fast_groups",
    "host_topology_from_answers",
    "nvlink_per_link_gbps",
    "pcie_gbps",
    "pcie_only_host_topology",
]

#: GB/s per direction per NVLink by ``nvmlNvlinkVersion_t`` value (NCCL's SM80/SM90/SM100
#: figures: 4 = NVLink 3.0, 5 = 3.1, 6 = 4.0, 7 = 5.0).
NVLINK_GBPS_BY_VERSION: dict[int, float] = {4: 20.0, 5: 20.0, 6: 20.6, 7: 40.1}
#: The same figures by compute-capability major (8 = Ampere, 9 = Hopper, 10 = Blackwell).
NVLINK_GBPS_BY_SM_MAJOR: dict[int, float] = {8: 20.0, 9: 20.6, 10: 40.1}
#: PCIe Gen3 x16, GB/s per direction (NCCL's figure); other links scale by gen and width.
PCIE_GEN3_X16_GBPS = 12.0

NVLINK_LATENCY_US = 0.7
PCIE_SWITCH_LATENCY_US = 1.0  # INTERNAL / SINGLE / MULTIPLE
PCIE_HOST_LATENCY_US = 1.5  # HOSTBRIDGE / NODE: through the CPU's root complex
CROSS_SOCKET_LINK = LinkProfile(DEFAULT_SHM_LINK.bandwidth_gbps, 2.0, "shm", "estimated")
PCIE_UNKNOWN_LINK = LinkProfile(PCIE_GEN3_X16_GBPS, PCIE_HOST_LATENCY_US, "pcie", "estimated")

_FIGURES_NOTE = (
    "link figures are GB/s per direction: NVLink = link count x NCCL's per-link figure; "
    f"PCIe scaled from Gen3 x16 = {PCIE_GEN3_X16_GBPS}; pairs across sockets (SYSTEM) use "
    "the host shared-memory estimate"
)
_NODE = TOPOLOGY_LEVELS["NODE"]
_SWITCHED = TOPOLOGY_LEVELS["MULTIPLE"]


@dataclass(frozen=True)
class CudaDeviceId:
    """How the CUDA runtime identifies one visible device (to match it with NVML)."""

    uuid: str | None = None
    bus_id: str | None = None


def nvlink_per_link_gbps(version: int | None, sm_major: int | None) -> tuple[float, str]:
    """``(GB/s per direction, why)`` for one NVLink: by NVLink version, else SM, else lowest."""
    if version in NVLINK_GBPS_BY_VERSION:
        return NVLINK_GBPS_BY_VERSION[version], f"NVLink version value {version}"
    if sm_major in NVLINK_GBPS_BY_SM_MAJOR:
        return NVLINK_GBPS_BY_SM_MAJOR[sm_major], f"SM {sm_major}x"
    if sm_major is not None and sm_major > max(NVLINK_GBPS_BY_SM_MAJOR):
        return NVLINK_GBPS_BY_SM_MAJOR[max(NVLINK_GBPS_BY_SM_MAJOR)], f"SM {sm_major}x (newest)"
    lowest = min(NVLINK_GBPS_BY_VERSION.values())
    return lowest, f"unknown NVLink version {version}: lowest known figure"


def pcie_gbps(gen: int | None, width: int | None) -> float | None:
    """GB/s per direction of a PCIe link: Gen3 x16 = 12, doubling per generation."""
    if not gen or not width:
        return None
    return PCIE_GEN3_X16_GBPS * 2.0 ** (gen - 3) * width / 16


def _is_switch(link_remote_type: str | None, remote_bus: str | None, gpu_buses: set[str]) -> bool:
    if link_remote_type is not None:
        return link_remote_type == "switch"
    return remote_bus is not None and remote_bus not in gpu_buses


def _nvlink_profile(
    a: GpuAnswer, b: GpuAnswer, gpu_buses: set[str]
) -> tuple[LinkProfile, str] | None:
    active_a = [link for link in a.nvlinks if link.active]
    active_b = [link for link in b.nvlinks if link.active]
    direct = [link for link in active_a if link.remote_bus_id == b.bus_id]
    if not direct:  # only one side may report the peer's bus id
        direct = [link for link in active_b if link.remote_bus_id == a.bus_id]
    switch_a = [x for x in active_a if _is_switch(x.remote_type, x.remote_bus_id, gpu_buses)]
    switch_b = [x for x in active_b if _is_switch(x.remote_type, x.remote_bus_id, gpu_buses)]
    via_switch = min(len(switch_a), len(switch_b))
    used = direct + switch_a[:via_switch] + switch_b[:via_switch]
    if not used:
        return None
    versions = [link.version for link in used if link.version is not None]
    majors = [g.compute_capability[0] for g in (a, b) if g.compute_capability]
    per_link, why = nvlink_per_link_gbps(
        min(versions) if versions else None, min(majors) if majors else None
    )
    count = len(direct) + via_switch
    profile = LinkProfile(round(count * per_link, 3), NVLINK_LATENCY_US, "nvlink", "discovered")
    route = "through NVSwitch" if via_switch else "direct"
    return profile, f"NVLink {count} x {per_link} GB/s {route} ({why})"


def _pcie_profile(a: GpuAnswer, b: GpuAnswer, level: int | None) -> LinkProfile:
    if level is None or level > _NODE:
        return CROSS_SOCKET_LINK
    figures = [pcie_gbps(g.pcie_gen, g.pcie_width) for g in (a, b)]
    known = [f for f in figures if f is not None]
    if not known:
        return PCIE_UNKNOWN_LINK
    latency = PCIE_SWITCH_LATENCY_US if level <= _SWITCHED else PCIE_HOST_LATENCY_US
    source: LinkSource = "discovered" if len(known) == 2 else "estimated"
    return LinkProfile(round(min(known), 3), latency, "pcie", source)


def _components(nodes: list[int], edges: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    parent = {n: n for n in nodes}

    def root(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for x, y in edges:
        parent[root(x)] = root(y)
    groups: dict[int, list[int]] = {}
    for n in nodes:
        groups.setdefault(root(n), []).append(n)
    return sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: g[0])


def fast_groups(links: tuple[LocalLink, ...], indices: list[int]) -> tuple[tuple[int, ...], ...]:
    """NVLink islands; devices without NVLink grouped by their peer-to-peer PCIe links."""
    nvlink = [(x.index_a, x.index_b) for x in links if x.profile.kind == "nvlink"]
    on_nvlink = {i for edge in nvlink for i in edge}
    rest = [i for i in indices if i not in on_nvlink]
    pcie = [
        (x.index_a, x.index_b)
        for x in links
        if x.profile.kind == "pcie" and x.index_a in rest and x.index_b in rest
    ]
    islands = _components(sorted(on_nvlink), nvlink) + _components(rest, pcie)
    return tuple(sorted(islands, key=lambda g: g[0]))


def _match_visible(
    answers: NvmlAnswers, visible: list[CudaDeviceId] | None
) -> tuple[list[GpuAnswer], list[str]]:
    """NVML GPUs in CUDA index order, and notes on how they were matched."""
    gpus = sorted(answers.gpus, key=lambda g: g.index)
    if visible is None:
        return gpus, ["CUDA device list unknown: assuming CUDA order = NVML order"]
    by_uuid = {_bare_uuid(g.uuid): g for g in gpus if g.uuid}
    by_bus = {g.bus_id: g for g in gpus}
    matched: list[GpuAnswer] = []
    for k, dev in enumerate(visible):
        gpu = by_uuid.get(_bare_uuid(dev.uuid)) if dev.uuid else None
        if gpu is None and dev.bus_id:
            gpu = by_bus.get(normalize_bus_id(dev.bus_id))
        if gpu is None:
            n = len(visible)
            return gpus[:n], [f"CUDA device {k} matches no NVML GPU: assuming NVML order"]
        matched.append(gpu)
    return matched, [f"{len(matched)} CUDA device(s) matched to NVML GPUs by UUID / bus id"]


def _bare_uuid(uuid: str | None) -> str:
    text = (uuid or "").strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


def host_topology_from_answers(
    answers: NvmlAnswers,
    local_rank: int,
    visible: list[CudaDeviceId] | None = None,
    host: str | None = None,
    numa_cpus: dict[int, str] | None = None,
) -> HostTopology:
    """The HostTopology of ``local_rank`` from NVML answers (links by CUDA device index).

    ``visible`` lists the CUDA runtime's devices in index order (``None``: NVML order);
    ``numa_cpus`` is the host's NUMA map (e.g. from sysfs); nodes it lacks are filled in
    from the GPUs' NVML NUMA node and CPU affinity.
    """
    gpus, notes = _match_visible(answers, visible)
    notes = list(answers.notes) + notes
    numa_cpus = dict(numa_cpus or {})
    for g in answers.gpus:
        if g.numa_node is not None and g.numa_node >= 0 and g.cpu_affinity:
            numa_cpus.setdefault(g.numa_node, g.cpu_affinity)
    buses = {g.bus_id for g in answers.gpus}
    links: list[LocalLink] = []
    nvlink_notes: dict[str, None] = {}
    for i, a in enumerate(gpus):
        for j in range(i + 1, len(gpus)):
            b = gpus[j]
            found = _nvlink_profile(a, b, buses)
            if found is not None:
                nvlink_notes.setdefault(found[1], None)
            profile = found[0] if found else _pcie_profile(a, b, answers.level(a.index, b.index))
            links.append(LocalLink(i, j, profile))
    kinds = sorted({link.profile.kind for link in links})
    notes.append(f"{len(links)} GPU pair link(s): {', '.join(kinds) or 'none'}")
    notes.extend(nvlink_notes)
    notes.append(_FIGURES_NOTE)
    if not gpus:
        notes.append("NVML lists no GPU visible to CUDA")
    index = local_rank % len(gpus) if gpus else local_rank
    return HostTopology(
        host=host or socket.gethostname(),
        device_type="cuda",
        local_rank=local_rank,
        device_index=index,
        numa_node=_numa_of(gpus[index], numa_cpus) if gpus else None,
        numa_cpus=dict(sorted(numa_cpus.items())),
        local_links=tuple(links),
        fast_groups=fast_groups(tuple(links), list(range(len(gpus)))),
        intra_host_default=CROSS_SOCKET_LINK,
        notes=tuple(notes),
    )


def _numa_of(gpu: GpuAnswer, numa_cpus: dict[int, str]) -> int | None:
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        return gpu.numa_node
    if gpu.cpu_affinity and numa_cpus:
        return numa_node_of_cpus(parse_cpulist(gpu.cpu_affinity), numa_cpus)
    return None


def pcie_only_host_topology(
    local_rank: int,
    reason: str,
    visible: list[CudaDeviceId] | None = None,
    host: str | None = None,
    sysfs_root: str = "/sys",
) -> HostTopology:
    """What can be said without NVML: no links known, every pair a PCIe Gen3 x16 estimate."""
    numa_cpus = read_numa_nodes(sysfs_root)
    index = local_rank % len(visible) if visible else local_rank
    bus_id = visible[index].bus_id if visible else None
    numa_node = _sysfs_numa_node(sysfs_root, bus_id) if bus_id else None
    return HostTopology(
        host=host or socket.gethostname(),
        device_type="cuda",
        local_rank=local_rank,
        device_index=index,
        numa_node=numa_node,
        numa_cpus=numa_cpus,
        intra_host_default=PCIE_UNKNOWN_LINK,
        notes=(
            f"NVML not available ({reason}): topology is PCIe-only estimates",
            f"every GPU pair assumed PCIe Gen3 x16 ({PCIE_GEN3_X16_GBPS} GB/s, estimated); "
            "no NVLink islands known, so the host is one fast domain",
        ),
    )


def _sysfs_numa_node(sysfs_root: str, bus_id: str) -> int | None:
    try:
        path = f"{sysfs_root}/bus/pci/devices/{normalize_bus_id(bus_id)}/numa_node"
        with open(path, encoding="ascii") as handle:
            node = int(handle.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _cuda_visible() -> list[CudaDeviceId] | None:
    """The CUDA runtime's devices (UUID and PCI address); ``None`` when CUDA is unavailable."""
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = getattr(props, "uuid", None)
        parts = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
        bus = None
        if all(isinstance(p, int) for p in parts):
            bus = f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0"
        devices.append(CudaDeviceId(str(uuid) if uuid is not None else None, bus))
    return devices


def discover_host_topology(local_rank: int, local_world_size: int) -> HostTopology:
    """Live discovery: NVML when it answers, else the PCIe-only estimate saying why."""
    visible = _cuda_visible()
    try:
        answers = query_nvml()
    except NvmlUnavailableError as exc:
        return pcie_only_host_topology(local_rank, str(exc), visible)
    piece = host_topology_from_answers(answers, local_rank, visible, numa_cpus=read_numa_nodes())
    if local_world_size > len(answers.gpus) > 0:
        extra = f"{local_world_size} local ranks share {len(answers.gpus)} GPU(s)"
        piece = replace(piece, notes=(*piece.notes, extra))
    return piece
