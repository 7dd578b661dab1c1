"""CPU host discovery from Linux sysfs: NUMA nodes, CPU lists, the process's node."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from lamina.device.sysfs import (
    discover_cpu_host,
    numa_node_of_cpus,
    parse_cpulist,
    read_numa_nodes,
)


def _fake_sysfs(root: Path, nodes: dict[str, str]) -> Path:
    base = root / "devices" / "system" / "node"
    base.mkdir(parents=True)
    for name, cpulist in nodes.items():
        (base / name).mkdir()
        (base / name / "cpulist").write_text(cpulist + "\n")
    # Files next to the node directories that are not nodes.
    (base / "possible").write_text("0-1\n")
    (base / "power").mkdir()
    return root


def test_read_numa_nodes_reads_each_node_cpulist_stripped(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path, {"node0": "0-3", "node1": "4-7"})
    assert read_numa_nodes(root) == {0: "0-3", 1: "4-7"}
    assert read_numa_nodes(str(root)) == {0: "0-3", 1: "4-7"}


def test_read_numa_nodes_orders_nodes_numerically(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path, {"node10": "8", "node2": "4", "node0": "0"})
    assert list(read_numa_nodes(root)) == [0, 2, 10]


def test_read_numa_nodes_without_node_dir_is_empty(tmp_path: Path) -> None:
    assert read_numa_nodes(tmp_path) == {}
    assert read_numa_nodes(tmp_path / "does-not-exist") == {}


def test_read_numa_nodes_skips_node_without_cpulist(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path, {"node0": "0-3"})
    (root / "devices" / "system" / "node" / "node1").mkdir()
    assert read_numa_nodes(root) == {0: "0-3"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
        ("0", {0}),
        ("5-5", {5}),
        ("0-3\n", {0, 1, 2, 3}),
        ("", set()),
        ("  \n", set()),
        ("1, 3", {1, 3}),
        ("64-66,0", {0, 64, 65, 66}),
    ],
)
def test_parse_cpulist_accepts_sysfs_cpu_lists(text: str, expected: set[int]) -> None:
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["a", "0-", "-3", "3-1", "1,,2", "0-3,x", "1.5", "²", "0-3:2"])
def test_parse_cpulist_rejects_bad_text_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="bad CPU list") as info:
        parse_cpulist(text)
    assert repr(text) in str(info.value)


def test_numa_node_of_cpus_picks_node_holding_most_cpus() -> None:
    nodes = {0: "0-3", 1: "4-7"}
    assert numa_node_of_cpus({4, 5}, nodes) == 1
    assert numa_node_of_cpus({0, 1, 2, 3}, nodes) == 0
    assert numa_node_of_cpus({3, 4, 5}, nodes) == 1


def test_numa_node_of_cpus_breaks_ties_toward_lowest_node() -> None:
    assert numa_node_of_cpus({3, 4}, {1: "4-7", 0: "0-3"}) == 0


def test_numa_node_of_cpus_none_without_nodes_or_overlap() -> None:
    assert numa_node_of_cpus({0, 1}, {}) is None
    assert numa_node_of_cpus({99}, {0: "0-3", 1: "4-7"}) is None
    assert numa_node_of_cpus(set(), {0: "0-3"}) is None


def test_numa_node_of_cpus_ignores_unparseable_node() -> None:
    assert numa_node_of_cpus({0, 1}, {0: "garbage", 1: "0-1"}) == 1


def test_discover_cpu_host_on_this_machine_reports_hostname_and_cpu() -> None:
    host = discover_cpu_host(3)
    assert host.host == socket.gethostname()
    assert host.device_type == "cpu"
    assert host.local_rank == 3
    assert host.device_index == 3
    assert host.local_links == ()
    assert host.fast_groups == ()
    assert host.notes
    assert host.numa_node is None or host.numa_node in host.numa_cpus


def test_discover_cpu_host_uses_fake_sysfs_for_numa(tmp_path: Path) -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no sched_getaffinity on this platform")
    allowed = sorted(os.sched_getaffinity(0))
    # Put every CPU this process may use on node 1, none on node 0.
    high = max(allowed) + 1
    cpulist = ",".join(str(c) for c in allowed)
    root = _fake_sysfs(tmp_path, {"node0": f"{high}-{high + 3}", "node1": cpulist})
    host = discover_cpu_host(0, sysfs_root=root)
    assert host.numa_cpus == {0: f"{high}-{high + 3}", 1: cpulist}
    assert host.numa_node == 1
    assert any("2 NUMA node(s)" in note for note in host.notes)


def test_discover_cpu_host_without_numa_info_notes_it(tmp_path: Path) -> None:
    host = discover_cpu_host(1, sysfs_root=tmp_path)
    assert host.numa_node is None
    assert host.numa_cpus == {}
    assert any("no NUMA information" in note for note in host.notes)


def test_discover_cpu_host_without_affinity_leaves_numa_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _fake_sysfs(tmp_path, {"node0": "0-3"})
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    host = discover_cpu_host(0, sysfs_root=root)
    assert host.numa_node is None
    assert host.numa_cpus == {0: "0-3"}
    assert any("affinity unavailable" in note for note in host.notes)
