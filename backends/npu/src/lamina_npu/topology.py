"""Intra-host NPU topology: link kinds from CANN, bandwidths as labelled estimates.

What is queryable: torch_npu gives the device count and ``get_device_properties`` (name,
memory, core counts) but no link facts. CANN's runtime has ``aclrtGetDevicesTopo(dev,
other, &value)`` (libascendcl.so; documented for Atlas training/inference products), which
answers how two devices are joined: HCCS, HCCS switch, SIO (two dies of one package), the
same PCIe switch (PIX), a PCIe host bridge (PHB) or across NUMA nodes (SYS). It is called
through ctypes on the copy of libascendcl that torch_npu has already loaded.

Nothing reports link *bandwidth*, so each kind gets the estimate in :data:`LINK_ESTIMATES`
(``source="estimated"``); measure with a probe or declare a topology file when the figures
matter. When the query is unavailable, intra-host links default to an estimated HCCS link
(Ascend training boards join their chips with HCCS) and the notes say so.
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Callable, Sequence
from typing import Any

from lamina.device.sysfs import discover_cpu_host
from lamina.device.topology import HostTopology, LinkProfile, LocalLink
from lamina.units import format_bytes

__all__ = [
    "LINK_ESTIMATES",
    "TOPOLOGY_BITS",
    "TopologyQuery",
    "acl_topology_query",
    "classify_links",
    "discover_npu_host",
    "link_profile",
]

#: ``aclrtGetDevicesTopo`` answers a bit mask; the ACL_RT_DEVS_TOPOLOGY_* values by name.
TOPOLOGY_BITS: dict[str, int] = {
    "HCCS": 0x01,
    "PIX": 0x02,
    "PIB": 0x04,  # reserved
    "PHB": 0x08,
    "SYS": 0x10,
    "SIO": 0x20,
    "HCCS_SW": 0x40,
}

#: Estimated link figures per ACL topology kind (GB/s per direction, microseconds).
#: HCCS: Ascend 910's published HCCS rate is 240 Gbit/s (30 GB/s) per link; later chips
#: are at least as fast, so 30 GB/s is a floor. SIO (die-to-die) and the HCCS switch are
#: given the same floor. PCIe: a peer-to-peer copy through one switch, through the host
#: bridge, and across the inter-socket link, in falling order.
LINK_ESTIMATES: dict[str, LinkProfile] = {
    "SIO": LinkProfile(30.0, 1.0, "hccs", "estimated"),
    "HCCS": LinkProfile(30.0, 2.0, "hccs", "estimated"),
    "HCCS_SW": LinkProfile(30.0, 3.0, "hccs", "estimated"),
    "PIX": LinkProfile(16.0, 5.0, "pcie", "estimated"),
    "PHB": LinkProfile(12.0, 8.0, "pcie", "estimated"),
    "SYS": LinkProfile(8.0, 12.0, "pcie", "estimated"),
}

#: Kinds that join chips into one fast domain.
FAST_KINDS: frozenset[str] = frozenset({"SIO", "HCCS", "HCCS_SW"})

#: ``query(a, b)`` -> the topology bit mask of devices ``a`` and ``b``, or None on failure.
TopologyQuery = Callable[[int, int], int | None]


def link_kind(bits: int) -> str | None:
    """The best link kind set in an ``aclrtGetDevicesTopo`` mask (None if none is known)."""
    for name in ("SIO", "HCCS", "HCCS_SW", "PIX", "PHB", "SYS"):
        if bits & TOPOLOGY_BITS[name]:
            return name
    return None


def link_profile(bits: int) -> LinkProfile | None:
    """The estimated profile of the best link in ``bits`` (None if no known kind is set)."""
    kind = link_kind(bits)
    return LINK_ESTIMATES[kind] if kind is not None else None


def _components(nodes: Sequence[int], edges: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
    parent = {n: n for n in nodes}

    def find(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in edges:
        parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: g[0])


def classify_links(
    indices: Sequence[int], query: TopologyQuery
) -> tuple[tuple[LocalLink, ...], tuple[tuple[int, ...], ...], list[str]]:
    """Links and fast groups among device ``indices`` from ``query``, plus notes.

    Fast groups are the sets of devices joined (directly or through each other) by HCCS,
    HCCS switch or SIO links; none are returned when one group holds every device.
    """
    links: list[LocalLink] = []
    fast_edges: list[tuple[int, int]] = []
    failed = 0
    kinds: dict[str, int] = {}
    for pos, a in enumerate(indices):
        for b in indices[pos + 1 :]:
            bits = query(a, b)
            kind = link_kind(bits) if bits is not None else None
            if kind is None:
                failed += 1
                continue
            kinds[kind] = kinds.get(kind, 0) + 1
            links.append(LocalLink(a, b, LINK_ESTIMATES[kind]))
            if kind in FAST_KINDS:
                fast_edges.append((a, b))
    notes: list[str] = []
    if kinds:
        summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        notes.append(f"link kinds from aclrtGetDevicesTopo: {summary}; bandwidths estimated")
    if failed:
        notes.append(f"aclrtGetDevicesTopo gave no answer for {failed} device pair(s)")
    groups = _components(indices, fast_edges) if fast_edges else []
    if len(groups) == 1:
        groups = []
    return tuple(links), tuple(groups), notes


def acl_topology_query() -> TopologyQuery | None:
    """``aclrtGetDevicesTopo`` from the loaded libascendcl.so, or None when it is missing."""
    try:
        lib = ctypes.CDLL("libascendcl.so")
        fn: Any = lib.aclrtGetDevicesTopo
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64)]
    fn.restype = ctypes.c_int

    def query(a: int, b: int) -> int | None:
        value = ctypes.c_uint64(0)
        status = fn(a, b, ctypes.byref(value))
        return int(value.value) if status == 0 else None

    return query


def discover_npu_host(
    local_rank: int, npu: Any, query: TopologyQuery | None = None
) -> HostTopology:
    """This process's view of its host: NPU links from CANN, NUMA from sysfs.

    ``npu`` is ``torch.npu``; ``query`` defaults to :func:`acl_topology_query`.
    """
    count = int(npu.device_count())
    if count < 1:
        raise RuntimeError("no NPU is visible to this process; check ASCEND_RT_VISIBLE_DEVICES")
    index = local_rank % count
    npu.init()  # aclInit before calling the ACL runtime directly
    props = npu.get_device_properties(index)
    notes = [
        f"{count} NPU(s); device {index}: {props.name}, {format_bytes(int(props.total_memory))}"
    ]
    query = query or acl_topology_query()
    links: tuple[LocalLink, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    if query is None:
        notes.append(
            "aclrtGetDevicesTopo is not in this CANN's libascendcl.so: no link facts; "
            "intra-host links use an estimated HCCS link"
        )
    elif count > 1:
        links, groups, link_notes = classify_links(range(count), query)
        notes.extend(link_notes)
    cpu = discover_cpu_host(local_rank)
    notes.extend(cpu.notes)
    notes.append("NUMA node from this process's CPU affinity (torch_npu gives no PCI address)")
    return HostTopology(
        host=socket.gethostname(),
        device_type="npu",
        local_rank=local_rank,
        device_index=index,
        numa_node=cpu.numa_node,
        numa_cpus=cpu.numa_cpus,
        local_links=links,
        fast_groups=groups,
        intra_host_default=LINK_ESTIMATES["HCCS"],
        notes=tuple(notes),
    )
