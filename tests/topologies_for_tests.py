"""Declared topologies for tests (importable by spawned ranks)."""

from __future__ import annotations

import copy
from typing import Any

_TWO_HOSTS_OF_TWO: dict[str, Any] = {
    "version": 1,
    "devices": [
        {
            "rank": r,
            "local_rank": r % 2,
            "host": f"node-{'ab'[r // 2]}",
            "device_type": "cpu",
            "device_index": r % 2,
        }
        for r in range(4)
    ],
    "links": [
        {"a": 0, "b": 1, "bandwidth_gbps": 40.0, "latency_us": 1.0, "kind": "shm"},
        {"a": 2, "b": 3, "bandwidth_gbps": 40.0, "latency_us": 1.0, "kind": "shm"},
    ],
    "fast_domains": [{"name": "node-a", "ranks": [0, 1]}, {"name": "node-b", "ranks": [2, 3]}],
    "default_link": {"bandwidth_gbps": 12.5, "latency_us": 10.0, "kind": "network"},
}


def two_hosts_of_two() -> dict[str, Any]:
    """Ranks 0, 1 on node-a and 2, 3 on node-b, each host one fast domain (a fresh copy)."""
    return copy.deepcopy(_TWO_HOSTS_OF_TWO)


def two_hosts_interleaved() -> dict[str, Any]:
    """Ranks 0, 2 on node-a and 1, 3 on node-b (an interleaved launch), 0.1 GB/s between
    the hosts and 1 GB/s inside them (a fresh copy)."""
    data = copy.deepcopy(_TWO_HOSTS_OF_TWO)
    for device in data["devices"]:
        rank = device["rank"]
        device["host"] = f"node-{'ab'[rank % 2]}"
        device["local_rank"] = device["device_index"] = rank // 2
    data["links"] = [
        {"a": 0, "b": 2, "bandwidth_gbps": 1.0, "latency_us": 50.0, "kind": "shm"},
        {"a": 1, "b": 3, "bandwidth_gbps": 1.0, "latency_us": 50.0, "kind": "shm"},
    ]
    data["fast_domains"] = [
        {"name": "node-a", "ranks": [0, 2]},
        {"name": "node-b", "ranks": [1, 3]},
    ]
    data["default_link"] = {"bandwidth_gbps": 0.1, "latency_us": 200.0, "kind": "network"}
    return data
