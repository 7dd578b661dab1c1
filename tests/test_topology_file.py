"""Topology JSON files: exact round trip, atomic save and one-line errors for bad files."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lamina.device.topology import (
    DEFAULT_NETWORK_LINK,
    LINK_KINDS,
    DeviceInfo,
    HostTopology,
    LinkProfile,
    LocalLink,
    Topology,
    merge_host_topologies,
)
from lamina.device.topology_file import (
    load_topology,
    save_topology,
    topology_from_dict,
    topology_to_dict,
)
from lamina.errors import TopologyError

NVLINK = LinkProfile(450.0, 1.0, "nvlink", "declared")
IB = LinkProfile(25.0, 4.5, "network", "measured")


def _realistic() -> Topology:
    """2 hosts x 2 GPUs, NVLink inside each host, InfiniBand between hosts."""
    pieces = []
    for host in ("node-a", "node-b"):
        links = (LocalLink(0, 1, NVLINK),)
        for local in range(2):
            pieces.append(
                HostTopology(host, "cuda", local, local, numa_node=local, local_links=links)
            )
    return merge_host_topologies(pieces, default_link=IB)


def _valid() -> dict[str, Any]:
    return {
        "version": 1,
        "devices": [
            {"rank": 0, "local_rank": 0, "host": "a", "device_type": "cuda", "device_index": 0},
            {"rank": 1, "local_rank": 1, "host": "a", "device_type": "cuda", "device_index": 1},
            {"rank": 2, "local_rank": 0, "host": "b", "device_type": "cuda", "device_index": 0},
        ],
        "links": [
            {"a": 0, "b": 1, "bandwidth_gbps": 450.0, "latency_us": 1.0, "kind": "nvlink"},
        ],
        "fast_domains": [{"name": "a", "ranks": [0, 1]}, {"name": "b", "ranks": [2]}],
        "default_link": {"bandwidth_gbps": 12.5, "latency_us": 10.0, "kind": "network"},
    }


def test_realistic_topology_round_trips_through_save_and_load(tmp_path: Path) -> None:
    topo = _realistic()
    assert len(topo.links) == 2 and len(topo.fast_domains) == 2
    path = tmp_path / "topo.json"
    save_topology(topo, path)
    assert load_topology(path) == topo
    assert load_topology(str(path)) == topo


def test_dict_round_trip_is_exact() -> None:
    topo = _realistic()
    assert topology_from_dict(topology_to_dict(topo)) == topo
    bare = Topology((DeviceInfo(0, 0, "h", "cpu", 0),))
    assert topology_from_dict(topology_to_dict(bare)) == bare


def test_saved_file_is_pretty_sorted_and_deterministic(tmp_path: Path) -> None:
    first, second = tmp_path / "one.json", tmp_path / "two.json"
    save_topology(_realistic(), first)
    save_topology(_realistic(), second)
    text = first.read_text()
    assert text == second.read_text()
    assert text.endswith("\n") and "\n  " in text
    data = json.loads(text)
    assert data["version"] == 1
    assert text == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert all(link["a"] < link["b"] for link in data["links"])


def test_minimal_file_uses_defaults(tmp_path: Path) -> None:
    path = tmp_path / "min.json"
    device = {"rank": 0, "local_rank": 0, "host": "h", "device_type": "cpu", "device_index": 0}
    path.write_text(json.dumps({"version": 1, "devices": [device]}))
    topo = load_topology(path)
    assert topo.links == () and topo.fast_domains == ()
    assert topo.default_link == DEFAULT_NETWORK_LINK
    assert topo.device(0).numa_node is None


def test_links_are_normalized_and_source_defaults_to_declared() -> None:
    data = _valid()
    data["links"] = [{"a": 2, "b": 0, "bandwidth_gbps": 30, "latency_us": 0, "kind": "pcie"}]
    topo = topology_from_dict(data)
    (link,) = topo.links
    assert (link.a, link.b) == (0, 2)
    assert link.profile == LinkProfile(30.0, 0.0, "pcie", "declared")
    assert isinstance(link.profile.bandwidth_gbps, float)


def test_atomic_save_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "topo.json"
    path.write_text("old contents")
    save_topology(_realistic(), path)
    save_topology(_realistic(), path)
    assert sorted(os.listdir(tmp_path)) == ["topo.json"]
    assert load_topology(path) == _realistic()


def test_failed_save_keeps_old_file_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "topo.json"
    path.write_text("old contents")
    bad = Topology(
        (DeviceInfo(0, 0, "h", "cpu", 0),), default_link=LinkProfile(1.0, 1.0, "carrier-pigeon")
    )
    with pytest.raises(TopologyError, match=r"default_link\.kind"):
        save_topology(bad, path)
    assert path.read_text() == "old contents"
    assert sorted(os.listdir(tmp_path)) == ["topo.json"]


def test_bool_is_not_accepted_as_int_or_float() -> None:
    data = _valid()
    data["devices"][0]["rank"] = False
    with pytest.raises(TopologyError, match=r"devices\[0\]\.rank: must be an integer"):
        topology_from_dict(data, source="t.json")
    data = _valid()
    data["links"][0]["bandwidth_gbps"] = True
    with pytest.raises(TopologyError, match=r"links\[0\]\.bandwidth_gbps: must be a number"):
        topology_from_dict(data, source="t.json")


def test_unreadable_file_names_path_and_os_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(TopologyError) as info:
        load_topology(missing)
    assert str(missing) in str(info.value)
    assert "No such file" in str(info.value)


def test_unknown_kind_error_lists_link_kinds(tmp_path: Path) -> None:
    data = _valid()
    data["links"][0]["kind"] = "smoke-signal"
    with pytest.raises(TopologyError) as info:
        topology_from_dict(data, source="t.json")
    assert all(kind in str(info.value) for kind in LINK_KINDS)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], object]:
    """A mutation setting ``path`` (dotted, with list indices) to ``value``."""

    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value

    return mutate


def _drop(path: str) -> Callable[[dict[str, Any]], object]:
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[last]

    return mutate


def _append(key: str, item: Any) -> Callable[[dict[str, Any]], object]:
    return lambda data: data[key].append(item)


_DEV3 = {"rank": 4, "local_rank": 1, "host": "b", "device_type": "cuda", "device_index": 1}
_LINK = {"bandwidth_gbps": 10.0, "latency_us": 1.0, "kind": "pcie"}

# (test id, mutation of _valid() or raw file text, expected field path in the message)
BAD_FILES: list[tuple[str, Callable[[dict[str, Any]], object] | str, str]] = [
    ("json-syntax", '{"version": 1,\n  "devices": [}', "line 2 column"),
    ("top-level-array", "[1, 2]", "(top level)"),
    ("missing-version", _drop("version"), "version"),
    ("unsupported-version", _set("version", 2), "version"),
    ("unknown-top-key", _set("hosts", []), "hosts: unknown key"),
    ("unknown-device-key", _set("devices.1.gpu", 1), "devices[1].gpu"),
    ("unknown-link-key", _set("links.0.speed", 1), "links[0].speed"),
    ("missing-host", _drop("devices.2.host"), "devices[2].host"),
    ("string-rank", _set("devices.1.rank", "1"), "devices[1].rank"),
    ("bool-device-index", _set("devices.0.device_index", True), "devices[0].device_index"),
    ("float-local-rank", _set("devices.0.local_rank", 0.0), "devices[0].local_rank"),
    ("negative-bandwidth", _set("links.0.bandwidth_gbps", -5.0), "links[0].bandwidth_gbps"),
    ("zero-bandwidth", _set("links.0.bandwidth_gbps", 0), "links[0].bandwidth_gbps"),
    ("negative-latency", _set("links.0.latency_us", -1), "links[0].latency_us"),
    ("nan-bandwidth", _set("default_link.bandwidth_gbps", float("nan")), "default_link.band"),
    ("inf-latency", _set("links.0.latency_us", float("inf")), "links[0].latency_us"),
    ("empty-devices", _set("devices", []), "devices: must not be empty"),
    ("devices-not-list", _set("devices", {}), "devices: must be a JSON array"),
    ("duplicate-rank", _set("devices.2.rank", 1), "devices[2].rank"),
    ("rank-gap", _set("devices.2.rank", 5), "devices[2].rank"),
    ("duplicate-host-slot", _set("devices.1.local_rank", 0), "devices[1].local_rank"),
    ("negative-local-rank", _set("devices.0.local_rank", -1), "devices[0].local_rank"),
    ("negative-device-index", _set("devices.2.device_index", -2), "devices[2].device_index"),
    ("empty-host", _set("devices.0.host", ""), "devices[0].host"),
    ("bad-numa", _set("devices.0.numa_node", "zero"), "devices[0].numa_node"),
    ("unknown-kind", _set("links.0.kind", "carrier-pigeon"), "links[0].kind"),
    ("unknown-source", _set("links.0.source", "guessed"), "links[0].source"),
    ("default-link-kind", _set("default_link.kind", "warp"), "default_link.kind"),
    ("default-link-key", _set("default_link.a", 0), "default_link.a"),
    ("dangling-link", _set("links.0.b", 7), "links[0].b"),
    ("self-link", _set("links.0.b", 0), "links[0].b"),
    ("duplicate-link", _append("links", {"a": 1, "b": 0, **_LINK}), "links[1]"),
    ("link-missing-kind", _drop("links.0.kind"), "links[0].kind"),
    ("domain-unknown-rank", _set("fast_domains.1.ranks", [2, 9]), "fast_domains[1].ranks[1]"),
    ("rank-in-two-domains", _set("fast_domains.1.ranks", [2, 0]), "fast_domains[1].ranks[1]"),
    ("duplicate-domain-name", _set("fast_domains.1.name", "a"), "fast_domains[1].name"),
    ("empty-domain", _set("fast_domains.0.ranks", []), "fast_domains[0].ranks"),
    ("domain-key", _set("fast_domains.0.size", 2), "fast_domains[0].size"),
    ("rank-beyond-world", _append("devices", _DEV3), "devices[3].rank"),
]


@pytest.mark.parametrize(
    ("mutation", "field"), [(m, f) for _, m, f in BAD_FILES], ids=[i for i, _, _ in BAD_FILES]
)
def test_bad_file_raises_one_line_error_naming_file_and_field(
    tmp_path: Path, mutation: Callable[[dict[str, Any]], object] | str, field: str
) -> None:
    if isinstance(mutation, str):
        text = mutation
    else:
        data = copy.deepcopy(_valid())
        mutation(data)
        text = json.dumps(data)
    path = tmp_path / "bad-topo.json"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert field in message
    assert "; " in message


def test_duplicate_json_key_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "dupe.json"
    text = json.dumps(_valid())
    path.write_text(text.replace('"version": 1', '"version": 1, "version": 1', 1))
    with pytest.raises(TopologyError, match="version: key given more than once"):
        load_topology(path)


def test_unknown_key_error_lists_allowed_keys() -> None:
    data = _valid()
    data["devices"][0]["gpu"] = 0
    with pytest.raises(TopologyError) as info:
        topology_from_dict(data, source="t.json")
    message = str(info.value)
    assert message.startswith("t.json: devices[0].gpu: unknown key;")
    for key in ("rank", "local_rank", "host", "device_type", "device_index", "numa_node"):
        assert key in message


def test_message_matches_documented_shape() -> None:
    data = _valid()
    data["links"][0]["bandwidth_gbps"] = -5.0
    with pytest.raises(TopologyError) as info:
        topology_from_dict(data, source="topo.json")
    assert str(info.value) == (
        "topo.json: links[0].bandwidth_gbps: must be > 0, got -5.0; "
        "give the link's bandwidth in GB/s per direction"
    )
