"""Where a group's ranks sit: hosts, rank order along a ring, and the ring's bottleneck.

A :class:`HostLayout` lists the ranks of one process group host by host, from the
topology (host names, never rank numbers: an interleaved launch puts consecutive ranks
on different hosts). It answers what the topology-aware collectives need: can the group
be split into equal per-host groups (hierarchical algorithms), what ring visits each
host once (the ring in topology order), and how many ring edges leave each host (each
crossing shares the host's uplink).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from lamina.device.topology import Topology


@dataclass(frozen=True)
class HostLayout:
    """The ranks of a group grouped by host: ``hosts[i]`` holds host ``names[i]``'s
    ranks (ascending); hosts are ordered by their lowest rank."""

    names: tuple[str, ...]
    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, topology: Topology, ranks: Sequence[int] | None = None) -> HostLayout:
        """The layout of ``ranks`` (default: every rank of ``topology``)."""
        chosen = sorted(ranks) if ranks is not None else list(range(topology.world_size))
        by_host: dict[str, list[int]] = {}
        for rank in chosen:
            by_host.setdefault(topology.device(rank).host, []).append(rank)
        names = sorted(by_host, key=lambda h: by_host[h][0])
        return cls(tuple(names), tuple(tuple(by_host[h]) for h in names))

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return sum(len(h) for h in self.hosts)

    @property
    def host_count(self) -> int:
        """Hosts the group spans."""
        return len(self.hosts)

    @property
    def uniform(self) -> bool:
        """True when every host holds the same number of the group's ranks."""
        return len({len(h) for h in self.hosts}) == 1

    @property
    def per_host(self) -> int:
        """Ranks per host (the largest host's count when not uniform)."""
        return max(len(h) for h in self.hosts)

    @cached_property
    def _host_index(self) -> dict[int, int]:
        """Rank -> index of the first host listing it (built once: the ring models ask
        for every edge, and a group may hold thousands of ranks)."""
        index: dict[int, int] = {}
        for host, ranks in enumerate(self.hosts):
            for rank in ranks:
                index.setdefault(rank, host)
        return index

    def host_of(self, rank: int) -> int:
        """Index of the host holding ``rank``."""
        try:
            return self._host_index[rank]
        except KeyError:
            raise KeyError(f"rank {rank} is not in this group") from None

    def ring_order(self) -> tuple[int, ...]:
        """A ring visiting each host's ranks together: host 0's ranks, host 1's, ..."""
        return tuple(r for ranks in self.hosts for r in ranks)

    def rank_order(self) -> tuple[int, ...]:
        """The group's ranks in ascending order (the order a plain process group rings)."""
        return tuple(sorted(self.ring_order()))

    def local_groups(self) -> list[tuple[int, ...]]:
        """One group per host (the intra-host phase of a hierarchical collective)."""
        return list(self.hosts)

    def cross_groups(self) -> list[tuple[int, ...]]:
        """Group ``j``: the ``j``-th rank of every host (the inter-host phase); needs
        :attr:`uniform`."""
        if not self.uniform:
            raise ValueError("hosts hold different numbers of ranks: no cross-host groups")
        return [tuple(ranks[j] for ranks in self.hosts) for j in range(self.per_host)]

    def crossings(self, order: Sequence[int]) -> int:
        """The most ring edges that leave (or enter) one host, for a ring in ``order``:
        they share that host's uplink, so the ring runs at uplink bandwidth / this."""
        if len(order) < 2:
            return 0
        out = [0] * self.host_count
        into = [0] * self.host_count
        for k, rank in enumerate(order):
            src, dst = self.host_of(rank), self.host_of(order[(k + 1) % len(order)])
            if src != dst:
                out[src] += 1
                into[dst] += 1
        return max(max(out), max(into))


def ring_bottleneck_gbps(topology: Topology, order: Sequence[int]) -> float:
    """The slowest edge of a ring over ``order``: each edge's link bandwidth (GB/s) over
    the number of ring edges sharing its hosts' uplink (edges inside a host share
    nothing)."""
    layout = HostLayout.of(topology, order)
    share = layout.crossings(order)
    slowest = float("inf")
    for k, rank in enumerate(order):
        nxt = order[(k + 1) % len(order)]
        bandwidth = topology.link(rank, nxt).bandwidth_gbps
        if layout.host_of(rank) != layout.host_of(nxt):
            bandwidth /= max(1, share)
        slowest = min(slowest, bandwidth)
    return slowest


def best_ring(layout: HostLayout) -> tuple[int, ...]:
    """The rank order whose ring crosses each host's uplink least (once out, once in per
    host): each host's ranks in a row. With one host or one rank per host every order is
    as good, and the ranks keep their order."""
    return layout.ring_order()


def hierarchy_unavailable(layout: HostLayout) -> str:
    """'' when ``layout`` can run the hierarchical algorithms (two or more hosts, each
    with the same number of ranks, two or more), else why not."""
    if layout.host_count < 2:
        return "the group is on one host"
    if layout.per_host < 2:
        return "one rank per host: the flat ring already crosses each uplink once"
    if not layout.uniform:
        return f"hosts hold different numbers of ranks {[len(h) for h in layout.hosts]}"
    return ""
