"""The Topology model and merging per-rank HostTopology pieces into one Topology."""

from __future__ import annotations

import pytest

from lamina.device.topology import (
    DEFAULT_NETWORK_LINK,
    DEFAULT_SHM_LINK,
    DeviceInfo,
    FastDomain,
    HostTopology,
    Link,
    LinkProfile,
    LocalLink,
    Topology,
    merge_host_topologies,
)

NVLINK = LinkProfile(450.0, 1.0, "nvlink", "discovered")
PCIE = LinkProfile(32.0, 3.0, "pcie", "estimated")
IB = LinkProfile(50.0, 5.0, "network", "declared")


def _two_hosts() -> list[HostTopology]:
    """node-a: two GPUs joined by NVLink; node-b: two GPUs with no discovered link."""
    a_links = (LocalLink(0, 1, NVLINK),)
    return [
        HostTopology("node-a", "cuda", 0, 0, numa_node=0, local_links=a_links),
        HostTopology("node-a", "cuda", 1, 1, numa_node=1, local_links=a_links),
        HostTopology("node-b", "cuda", 0, 0, intra_host_default=PCIE),
        HostTopology("node-b", "cuda", 1, 1, intra_host_default=PCIE),
    ]


def test_merge_builds_one_device_per_rank_in_rank_order() -> None:
    topo = merge_host_topologies(_two_hosts())
    assert topo.world_size == 4
    assert topo.devices == (
        DeviceInfo(0, 0, "node-a", "cuda", 0, 0),
        DeviceInfo(1, 1, "node-a", "cuda", 1, 1),
        DeviceInfo(2, 0, "node-b", "cuda", 0, None),
        DeviceInfo(3, 1, "node-b", "cuda", 1, None),
    )
    assert topo.device(2).host == "node-b"


def test_merge_links_ranks_on_a_host_by_its_local_link() -> None:
    topo = merge_host_topologies(_two_hosts())
    assert topo.link(0, 1) == NVLINK
    assert topo.link(1, 0) == NVLINK


def test_merge_falls_back_to_intra_host_default_without_local_link() -> None:
    topo = merge_host_topologies(_two_hosts())
    assert topo.link(2, 3) == PCIE
    pieces = [HostTopology("h", "cpu", 0, 0), HostTopology("h", "cpu", 1, 1)]
    assert merge_host_topologies(pieces).link(0, 1) == DEFAULT_SHM_LINK


def test_merge_cross_host_pairs_use_default_link() -> None:
    topo = merge_host_topologies(_two_hosts(), default_link=IB)
    assert topo.links == (Link(0, 1, NVLINK), Link(2, 3, PCIE))
    for x, y in [(0, 2), (0, 3), (1, 2), (3, 1)]:
        assert topo.link(x, y) == IB
    assert merge_host_topologies(_two_hosts()).link(0, 2) == DEFAULT_NETWORK_LINK


def test_merge_makes_one_fast_domain_per_host_by_default() -> None:
    topo = merge_host_topologies(_two_hosts())
    assert topo.fast_domains == (FastDomain("node-a", (0, 1)), FastDomain("node-b", (2, 3)))
    assert topo.domain_of(0) == FastDomain("node-a", (0, 1))
    assert topo.domain_of(3) == FastDomain("node-b", (2, 3))


def test_merge_fast_groups_split_a_host_into_two_domains() -> None:
    groups = ((0, 1), (2, 3))
    pieces = [
        HostTopology("dgx", "cuda", i, i, fast_groups=groups, intra_host_default=PCIE)
        for i in range(4)
    ]
    topo = merge_host_topologies(pieces)
    assert topo.fast_domains == (FastDomain("dgx/0", (0, 1)), FastDomain("dgx/1", (2, 3)))
    assert topo.domain_of(1) == FastDomain("dgx/0", (0, 1))
    assert topo.domain_of(2) == FastDomain("dgx/1", (2, 3))
    # Every pair on the host is still linked (by the intra-host default here).
    assert len(topo.links) == 6
    assert topo.link(1, 2) == PCIE


def test_merge_uses_device_index_not_local_rank_for_local_links() -> None:
    link = (LocalLink(2, 3, NVLINK),)
    pieces = [
        HostTopology("h", "cuda", 0, 2, local_links=link),
        HostTopology("h", "cuda", 1, 3, local_links=link),
    ]
    assert merge_host_topologies(pieces).link(0, 1) == NVLINK


def test_hosts_are_listed_in_order_of_lowest_rank() -> None:
    devices = (
        DeviceInfo(1, 0, "late", "cpu", 0),
        DeviceInfo(0, 0, "early", "cpu", 0),
        DeviceInfo(2, 1, "late", "cpu", 1),
    )
    topo = Topology(devices)
    assert topo.hosts() == ["early", "late"]
    assert topo.ranks_on_host("late") == [1, 2]
    assert topo.ranks_on_host("early") == [0]
    assert topo.ranks_on_host("nowhere") == []
    assert topo.device(1) == DeviceInfo(1, 0, "late", "cpu", 0)


def test_domain_of_rank_outside_every_domain_is_none() -> None:
    topo = Topology((DeviceInfo(0, 0, "h", "cpu", 0), DeviceInfo(1, 1, "h", "cpu", 1)))
    assert topo.domain_of(0) is None
    assert topo.link(0, 1) == DEFAULT_NETWORK_LINK


def test_summary_counts_ranks_hosts_links_and_domains() -> None:
    topo = merge_host_topologies(_two_hosts())
    assert topo.summary() == "4 rank(s) on 2 host(s), 2 link(s), 2 fast domain(s) of size [2]"
    bare = Topology((DeviceInfo(0, 0, "h", "cpu", 0),))
    assert bare.summary() == "1 rank(s) on 1 host(s), 0 link(s), 0 fast domain(s)"


@pytest.mark.parametrize("ranks", [[1], [0, 2], [0, 0], [1, 2, 3], [-1, 0]])
def test_topology_rejects_ranks_not_zero_to_n_minus_one(ranks: list[int]) -> None:
    devices = tuple(DeviceInfo(r, i, "h", "cpu", i) for i, r in enumerate(ranks))
    with pytest.raises(ValueError, match="device ranks must be 0"):
        Topology(devices)


def test_topology_is_immutable() -> None:
    topo = Topology((DeviceInfo(0, 0, "h", "cpu", 0),))
    with pytest.raises(AttributeError):
        topo.devices = ()  # type: ignore[misc]
