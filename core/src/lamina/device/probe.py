"""Measure the links of a topology with torch.distributed send/recv: ``topology="probe"``.

For every pair of hosts (by host name, so interleaved rank numbering does not matter) the
lowest ranks of the two hosts measure the link between them; on every host with two or
more ranks its two lowest ranks measure the link inside it. A measurement is a ping-pong
of one element (latency: half the median round trip) and ``nbytes`` sent one way and
acknowledged with one element (bandwidth: bytes over the median time less one latency).
Pairs run one after the other, every rank taking part in the barriers between them, and
the results are shared with every rank, which builds the same measured topology: every
link between two hosts gets their pair's profile, every link inside a host the host's,
each with ``source="measured"``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from lamina.device.topology import Link, LinkProfile, Topology

PING_ROUNDS = 10
#: Up to this many ranks every inter-host rank pair gets its hosts' measured link; beyond,
#: only the links inside hosts are listed and the slowest network pair is the default.
EXPLICIT_NETWORK_LINKS_UP_TO = 256


def probe_pairs(topology: Topology) -> list[tuple[int, int, str]]:
    """(rank a, rank b, kind) to measure: one pair per pair of hosts (``"network"``),
    one inside each host with two or more ranks (``"intra"``), in a fixed order."""
    by_host: dict[str, list[int]] = {}
    for device in sorted(topology.devices, key=lambda d: d.rank):
        by_host.setdefault(device.host, []).append(device.rank)
    hosts = sorted(by_host, key=lambda h: by_host[h][0])
    pairs = [
        (by_host[a][0], by_host[b][0], "network")
        for i, a in enumerate(hosts)
        for b in hosts[i + 1 :]
    ]
    pairs += [(ranks[0], ranks[1], "intra") for h in hosts if len(ranks := by_host[h]) > 1]
    return pairs


def _ping(peer: int, sender: bool, scalar: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """One round trip of ``scalar`` (seconds, measured on the sender)."""
    start = time.perf_counter()
    if sender:
        dist.send(scalar, peer, group=group)
        dist.recv(scalar, peer, group=group)
    else:
        dist.recv(scalar, peer, group=group)
        dist.send(scalar, peer, group=group)
    return time.perf_counter() - start


def _measure(
    a: int,
    b: int,
    rank: int,
    nbytes: int,
    iters: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> tuple[float, float] | None:
    """(latency us, bandwidth GB/s) of the a-b link, on rank ``a``; None elsewhere."""
    if rank not in (a, b):
        return None
    sender, peer = rank == a, b if rank == a else a
    scalar = torch.zeros(1, dtype=torch.float32, device=device)
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    rtts = [_ping(peer, sender, scalar, group) for _ in range(PING_ROUNDS)]
    latency = statistics.median(rtts) / 2
    times: list[float] = []
    for k in range(iters + 1):  # the first transfer warms the connection up
        start = time.perf_counter()
        if sender:
            dist.send(payload, peer, group=group)
            dist.recv(scalar, peer, group=group)
        else:
            dist.recv(payload, peer, group=group)
            dist.send(scalar, peer, group=group)
        if k:
            times.append(time.perf_counter() - start)
    if not sender:
        return None
    transfer = max(statistics.median(times) - latency, 1e-9)
    return latency * 1e6, payload.numel() * 4 / transfer / 1e9


def probe_topology(
    topology: Topology,
    rank: int,
    *,
    nbytes: int = 8 << 20,
    iters: int = 3,
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
) -> Topology:
    """``topology`` with measured links (see the module docstring); every rank calls it."""
    device = device or torch.device("cpu")
    found: dict[tuple[int, int], tuple[float, float]] = {}
    for a, b, _kind in probe_pairs(topology):
        dist.barrier(group=group)
        result = _measure(a, b, rank, nbytes, iters, device, group)
        if result is not None:
            found[(a, b)] = result
    shared: list[dict[tuple[int, int], tuple[float, float]] | None] = [None] * topology.world_size
    dist.all_gather_object(shared, found, group=group)
    measured = {pair: value for part in shared if part for pair, value in part.items()}
    return with_measurements(topology, measured)


def with_measurements(
    topology: Topology, measured: dict[tuple[int, int], tuple[float, float]]
) -> Topology:
    """``topology`` whose links carry the ``measured`` (latency us, GB/s) of their hosts'
    pair (see :func:`probe_pairs`); the default link becomes the slowest network pair.
    Measured profiles keep the kind of link discovery found inside a host."""
    host_of = {d.rank: d.host for d in topology.devices}
    profiles: dict[frozenset[str], LinkProfile] = {}
    for (a, b), (latency, bandwidth) in measured.items():
        # inside a host the link keeps the kind discovery gave it (shm, nvlink, ...)
        kind = "network" if host_of[a] != host_of[b] else topology.link(a, b).kind
        if kind == "network" and host_of[a] == host_of[b]:
            kind = "loopback"
        key = frozenset((host_of[a], host_of[b]))
        profiles[key] = LinkProfile(bandwidth, latency, kind, "measured")
    ranks = sorted(host_of)
    links: list[Link] = []
    existing = {(link.a, link.b): link for link in topology.links}
    explicit_network = len(ranks) <= EXPLICIT_NETWORK_LINKS_UP_TO
    for i, a in enumerate(ranks):
        for b in ranks[i + 1 :]:
            if host_of[a] != host_of[b] and not explicit_network:
                continue
            profile = profiles.get(frozenset((host_of[a], host_of[b])))
            if profile is not None:
                links.append(Link(a, b, profile))
            elif (a, b) in existing:
                links.append(existing[(a, b)])
    network = [p for p in profiles.values() if p.kind == "network"]
    default = min(network, key=lambda p: p.bandwidth_gbps) if network else topology.default_link
    return replace(topology, links=tuple(links), default_link=default)


def link_rows(topology: Topology) -> Sequence[tuple[str, str, LinkProfile]]:
    """(host a, host b, profile) of each measured host pair, for a table."""
    host_of = {d.rank: d.host for d in topology.devices}
    seen: dict[frozenset[str], tuple[str, str, LinkProfile]] = {}
    for link in topology.links:
        key = frozenset((host_of[link.a], host_of[link.b]))
        if link.profile.source == "measured" and key not in seen:
            seen[key] = (host_of[link.a], host_of[link.b], link.profile)
    return list(seen.values())
