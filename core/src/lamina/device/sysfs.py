"""Discover a CPU host's NUMA layout from Linux sysfs.

Everything here degrades quietly: on a machine without ``/sys/devices/system/node``
(non-NUMA kernels, macOS, Windows) the NUMA map is empty and the NUMA node is unknown.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from lamina.device.topology import HostTopology

__all__ = ["discover_cpu_host", "numa_node_of_cpus", "parse_cpulist", "read_numa_nodes"]

_NODE_DIR = re.compile(r"node(\d+)", re.ASCII)
_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)


def read_numa_nodes(sysfs_root: str | Path = "/sys") -> dict[int, str]:
    """NUMA node id -> its CPU list text (stripped), from ``{root}/devices/system/node``.

    Returns ``{}`` when the directory does not exist; nodes whose ``cpulist`` cannot be
    read are left out.
    """
    base = Path(sysfs_root) / "devices" / "system" / "node"
    if not base.is_dir():
        return {}
    nodes: dict[int, str] = {}
    for entry in base.iterdir():
        match = _NODE_DIR.fullmatch(entry.name)
        if match is None:
            continue
        try:
            text = (entry / "cpulist").read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError):
            continue
        nodes[int(match.group(1))] = text.strip()
    return dict(sorted(nodes.items()))


def parse_cpulist(text: str) -> set[int]:
    """The CPU ids of a sysfs CPU list such as ``"0-3,8,10-11"`` (empty text: no CPUs).

    Raises :class:`ValueError` naming ``text`` when it is not a valid CPU list.
    """
    cpus: set[int] = set()
    body = text.strip()
    if not body:
        return cpus
    for part in body.split(","):
        piece = part.strip()
        match = _RANGE.fullmatch(piece)
        if match is None:
            raise ValueError(
                f'bad CPU list {text!r}: {piece!r} is not N or N-M; write ranges like "0-3,8,10-11"'
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(
                f"bad CPU list {text!r}: range {piece!r} runs backwards; write it as "
                f'"{last}-{first}"'
            )
        cpus.update(range(first, last + 1))
    return cpus


def numa_node_of_cpus(cpus: set[int], nodes: dict[int, str]) -> int | None:
    """The NUMA node holding most of ``cpus`` (lowest id on a tie).

    ``None`` when there are no nodes or none holds any of ``cpus``. Nodes whose CPU list
    cannot be parsed are ignored.
    """
    best: int | None = None
    best_count = 0
    for node in sorted(nodes):
        try:
            count = len(cpus & parse_cpulist(nodes[node]))
        except ValueError:
            continue
        if count > best_count:
            best, best_count = node, count
    return best


def _affinity() -> set[int] | None:
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return None
    try:
        return set(getter(0))
    except OSError:
        return None


def discover_cpu_host(local_rank: int, sysfs_root: str | Path = "/sys") -> HostTopology:
    """What a CPU rank can learn about its host: name, NUMA nodes and its own NUMA node.

    The device is ``cpu`` with index ``local_rank``; the NUMA node is the one holding most
    of the CPUs this process may run on. There are no local links and no fast groups (the
    whole host is one fast domain).
    """
    nodes = read_numa_nodes(sysfs_root)
    cpus = _affinity()
    notes: list[str] = []
    if nodes:
        notes.append(f"{len(nodes)} NUMA node(s) from {sysfs_root}")
    else:
        notes.append(f"no NUMA information in {sysfs_root}")
    numa_node: int | None = None
    if cpus is None:
        notes.append("CPU affinity unavailable: NUMA node unknown")
    elif nodes:
        numa_node = numa_node_of_cpus(cpus, nodes)
        if numa_node is None:
            notes.append(f"affinity of {len(cpus)} CPU(s) matches no NUMA node")
        else:
            notes.append(f"process may run on {len(cpus)} CPU(s), mostly on NUMA node {numa_node}")
    return HostTopology(
        host=socket.gethostname(),
        device_type="cpu",
        local_rank=local_rank,
        device_index=local_rank,
        numa_node=numa_node,
        numa_cpus=nodes,
        local_links=(),
        fast_groups=(),
        notes=tuple(notes),
    )
