"""The Topology model: devices (one per rank), links with bandwidth, and fast domains.

Vocabulary: a *rank* is one training process and owns one *device*; a *host* is one
machine; a *link* joins two ranks (undirected, bandwidth per direction); a *fast domain*
is a set of ranks joined by fast links (an NVLink island, one host's shared memory).
Pairs with no explicit link use ``default_link``.

Sources: a backend discovers a :class:`HostTopology` per process; :func:`merge_host_topologies`
turns the per-rank pieces into one :class:`Topology`; or a file declares it
(see :mod:`lamina.device.topology_file`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

#: Link kinds lamina knows; a file naming another kind is rejected.
LINK_KINDS: frozenset[str] = frozenset(
    {"nvlink", "pcie", "shm", "network", "ici", "hccs", "loopback"}
)

#: Where a link figure comes from.
LinkSource = Literal["declared", "discovered", "estimated", "measured"]
LINK_SOURCES: frozenset[str] = frozenset({"declared", "discovered", "estimated", "measured"})


@dataclass(frozen=True)
class DeviceInfo:
    """The device one rank owns."""

    rank: int
    local_rank: int
    host: str
    device_type: str
    device_index: int
    numa_node: int | None = None


@dataclass(frozen=True)
class LinkProfile:
    """Bandwidth (GB/s per direction) and latency (microseconds) of a kind of link."""

    bandwidth_gbps: float
    latency_us: float
    kind: str
    source: LinkSource = "declared"


@dataclass(frozen=True)
class Link:
    """An undirected link between ranks ``a`` and ``b`` (``a < b``)."""

    a: int
    b: int
    profile: LinkProfile

    def joins(self, x: int, y: int) -> bool:
        """True when this link joins ranks ``x`` and ``y`` (in either order)."""
        return {self.a, self.b} == {x, y}


@dataclass(frozen=True)
class FastDomain:
    """A named group of ranks joined by fast links."""

    name: str
    ranks: tuple[int, ...]


#: Estimates used when nothing better is known (labelled ``source="estimated"``).
DEFAULT_NETWORK_LINK = LinkProfile(12.5, 10.0, "network", "estimated")
DEFAULT_SHM_LINK = LinkProfile(10.0, 1.0, "shm", "estimated")


@dataclass(frozen=True)
class Topology:
    """Devices of all ranks, links between them and fast domains; immutable and validated."""

    devices: tuple[DeviceInfo, ...]
    links: tuple[Link, ...] = ()
    fast_domains: tuple[FastDomain, ...] = ()
    default_link: LinkProfile = DEFAULT_NETWORK_LINK

    def __post_init__(self) -> None:
        ranks = [d.rank for d in self.devices]
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError(f"device ranks must be 0..{len(ranks) - 1} once each, got {ranks}")

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.devices)

    def device(self, rank: int) -> DeviceInfo:
        """The device of ``rank``."""
        return sorted(self.devices, key=lambda d: d.rank)[rank]

    def hosts(self) -> list[str]:
        """Host names in order of their lowest rank."""
        seen: dict[str, None] = {}
        for d in sorted(self.devices, key=lambda d: d.rank):
            seen.setdefault(d.host, None)
        return list(seen)

    def ranks_on_host(self, host: str) -> list[int]:
        """Ranks whose device is on ``host``, ascending."""
        return sorted(d.rank for d in self.devices if d.host == host)

    def link(self, x: int, y: int) -> LinkProfile:
        """The profile of the link joining ranks ``x`` and ``y`` (``default_link`` if none)."""
        for link in self.links:
            if link.joins(x, y):
                return link.profile
        return self.default_link

    def domain_of(self, rank: int) -> FastDomain | None:
        """The fast domain holding ``rank``, if any."""
        for domain in self.fast_domains:
            if rank in domain.ranks:
                return domain
        return None

    def summary(self) -> str:
        """One line: ranks, hosts, links and fast domains."""
        sizes = sorted({len(d.ranks) for d in self.fast_domains})
        return (
            f"{self.world_size} rank(s) on {len(self.hosts())} host(s), "
            f"{len(self.links)} link(s), {len(self.fast_domains)} fast domain(s)"
            + (f" of size {sizes}" if sizes else "")
        )


@dataclass(frozen=True)
class LocalLink:
    """A link between two device indices on one host, as a backend discovers it."""

    index_a: int
    index_b: int
    profile: LinkProfile


@dataclass(frozen=True)
class HostTopology:
    """What one process discovers about its own host and device."""

    host: str
    device_type: str
    local_rank: int
    device_index: int
    numa_node: int | None = None
    #: NUMA node id -> its CPU list as sysfs writes it (``"0-3,8-11"``).
    numa_cpus: dict[int, str] = field(default_factory=dict)
    #: Links between device indices of this host.
    local_links: tuple[LocalLink, ...] = ()
    #: Groups of device indices joined by fast links (empty: the whole host is one domain).
    fast_groups: tuple[tuple[int, ...], ...] = ()
    #: Link used between ranks of this host that have no explicit local link.
    intra_host_default: LinkProfile = DEFAULT_SHM_LINK
    #: Free-form notes from discovery (e.g. "NVML not found: PCIe-only estimates").
    notes: tuple[str, ...] = ()


def merge_host_topologies(
    pieces: Sequence[HostTopology], default_link: LinkProfile = DEFAULT_NETWORK_LINK
) -> Topology:
    """Combine the per-rank :class:`HostTopology` (index = rank) into one :class:`Topology`.

    Ranks are placed on hosts by host name. When a host's ranks report the same local
    rank (one launcher task per rank), each host's ranks are numbered in rank order.

    Ranks on the same host are linked by the host's discovered link between their device
    indices, or by the host's ``intra_host_default``. Each host's ``fast_groups`` become
    fast domains (the whole host when it declares none). Ranks on different hosts use
    ``default_link``.
    """
    position: dict[int, int] = {}  # a rank's index among its host's ranks
    seen: dict[str, int] = {}
    for rank, p in enumerate(pieces):
        position[rank] = seen.get(p.host, 0)
        seen[p.host] = position[rank] + 1
    local_ranks = [(p.host, p.local_rank) for p in pieces]
    # one launcher task per rank (SLURM's, interleaved hosts) gives every rank local rank
    # 0: the host name is what places a rank, so number each host's ranks in rank order
    renumber = len(set(local_ranks)) != len(local_ranks)
    devices = tuple(
        DeviceInfo(
            rank,
            position[rank] if renumber else p.local_rank,
            p.host,
            p.device_type,
            p.device_index,
            p.numa_node,
        )
        for rank, p in enumerate(pieces)
    )
    links: list[Link] = []
    domains: list[FastDomain] = []
    by_host: dict[str, list[int]] = {}
    for rank, p in enumerate(pieces):
        by_host.setdefault(p.host, []).append(rank)
    for host, ranks in by_host.items():
        host_info = pieces[ranks[0]]
        for i, ra in enumerate(ranks):
            for rb in ranks[i + 1 :]:
                ia, ib = pieces[ra].device_index, pieces[rb].device_index
                profile = _local_link(host_info.local_links, ia, ib) or host_info.intra_host_default
                links.append(Link(ra, rb, profile))
        domains.extend(_host_domains(host, ranks, pieces, host_info.fast_groups))
    return Topology(devices, tuple(links), tuple(domains), default_link)


def _local_link(links: Iterable[LocalLink], ia: int, ib: int) -> LinkProfile | None:
    for link in links:
        if {link.index_a, link.index_b} == {ia, ib}:
            return link.profile
    return None


def _host_domains(
    host: str,
    ranks: list[int],
    pieces: Sequence[HostTopology],
    groups: tuple[tuple[int, ...], ...],
) -> list[FastDomain]:
    if not groups:
        return [FastDomain(host, tuple(ranks))]
    domains = []
    for k, group in enumerate(groups):
        members = tuple(r for r in ranks if pieces[r].device_index in group)
        if members:
            domains.append(FastDomain(f"{host}/{k}", members))
    return domains
