"""Intra-host topology from aclrtGetDevicesTopo answers recorded from public board layouts.

The query answers are fixtures built from Huawei's public descriptions (ACL_RT_DEVS_TOPOLOGY_*
values from the aclrtGetDevicesTopo reference): Atlas 800 training server (Ascend 910, two
groups of four chips joined by HCCS, PCIe between the groups), Atlas 800T A2 (eight chips,
HCCS full mesh), Atlas A3 nodes (two dies per package joined by SIO, packages by HCCS),
and PCIe-only inference cards.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest

topology = pytest.importorskip("lamina_npu.topology", reason="lamina-backend-npu is not installed")

HCCS, PIX, PHB, SYS, SIO = 0x01, 0x02, 0x08, 0x10, 0x20


def _query(answer: Callable[[int, int], int | None]) -> Callable[[int, int], int | None]:
    calls: list[tuple[int, int]] = []

    def query(a: int, b: int) -> int | None:
        calls.append((a, b))
        return answer(a, b)

    query.calls = calls  # type: ignore[attr-defined]
    return query


def test_two_hccs_groups_of_four() -> None:
    query = _query(lambda a, b: HCCS if a // 4 == b // 4 else SYS)
    links, groups, notes = topology.classify_links(range(8), query)
    assert groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert len(links) == 28
    kinds = {(link.index_a, link.index_b): link.profile.kind for link in links}
    assert kinds[(0, 3)] == "hccs" and kinds[(3, 4)] == "pcie"
    assert all(link.profile.source == "estimated" for link in links)
    assert "12 HCCS, 16 SYS" in notes[0]


def test_full_mesh_is_one_domain() -> None:
    links, groups, _ = topology.classify_links(range(8), _query(lambda a, b: HCCS))
    assert groups == ()
    assert {link.profile.kind for link in links} == {"hccs"}


def test_sio_pairs_take_priority_over_hccs_bits() -> None:
    def answer(a: int, b: int) -> int:
        return SIO | HCCS if a // 2 == b // 2 else HCCS

    links, groups, notes = topology.classify_links(range(16), _query(answer))
    sio = [link for link in links if link.profile == topology.LINK_ESTIMATES["SIO"]]
    assert len(sio) == 8 and len(links) == 120
    assert groups == ()
    assert "8 SIO" in notes[0]


def test_pcie_only_cards_have_no_fast_groups() -> None:
    def answer(a: int, b: int) -> int:
        return PIX if a // 2 == b // 2 else PHB

    links, groups, _ = topology.classify_links(range(4), _query(answer))
    assert groups == ()
    assert {link.profile.kind for link in links} == {"pcie"}
    profile = {(link.index_a, link.index_b): link.profile for link in links}
    assert profile[(0, 1)].bandwidth_gbps > profile[(0, 2)].bandwidth_gbps


def test_failed_queries_are_noted() -> None:
    links, _, notes = topology.classify_links(
        range(3), _query(lambda a, b: None if b == 2 else HCCS)
    )
    assert len(links) == 1
    assert any("no answer for 2 device pair(s)" in note for note in notes)


def test_each_pair_is_queried_once() -> None:
    query = _query(lambda a, b: HCCS)
    topology.classify_links(range(4), query)
    assert query.calls == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]  # type: ignore[attr-defined]


class _RecordedNpu:
    """torch.npu's answers on a recorded 8-chip Atlas 800T A2 (only what discovery reads)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.initialized = False

    def device_count(self) -> int:
        return self.count

    def init(self) -> None:
        self.initialized = True

    def get_device_properties(self, index: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="Ascend910B1", total_memory=64 * 2**30)


def test_host_topology_assembly() -> None:
    npu = _RecordedNpu(8)
    host = topology.discover_npu_host(11, npu, query=_query(lambda a, b: HCCS))
    assert npu.initialized
    assert host.device_type == "npu" and host.device_index == 3 and host.local_rank == 11
    assert len(host.local_links) == 28 and host.fast_groups == ()
    assert host.intra_host_default.kind == "hccs"
    assert host.notes[0] == "8 NPU(s); device 3: Ascend910B1, 64 GiB"


def test_host_topology_without_the_query() -> None:
    host = topology.discover_npu_host(0, _RecordedNpu(2), query=None)
    if host.local_links:
        pytest.skip("this machine has libascendcl.so with aclrtGetDevicesTopo")
    assert any("no link facts" in note for note in host.notes)
    assert host.intra_host_default.source == "estimated"


def test_no_visible_npu_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="ASCEND_RT_VISIBLE_DEVICES"):
        topology.discover_npu_host(0, _RecordedNpu(0))
