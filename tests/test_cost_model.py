"""The alpha-beta cost model, host layouts and `lamina topo place` (no ranks started)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lamina.comm.cost import (
    ALGORITHMS,
    CostModel,
    LinkCost,
    choose_algorithm,
    choose_sharded_algorithm,
    unavailable_algorithms,
)
from lamina.comm.layout import HostLayout, best_ring, ring_bottleneck_gbps
from lamina.device.topology import DeviceInfo, Link, LinkProfile, Topology
from lamina.device.topology_file import topology_from_dict
from lamina.errors import ConfigError
from topologies_for_tests import two_hosts_interleaved, two_hosts_of_two

MIB = 1 << 20


def cluster(hosts: int, per_host: int, inter_gbps: float, interleaved: bool = True) -> Topology:
    """``hosts`` x ``per_host`` ranks, 1 GB/s inside a host, ``inter_gbps`` between."""
    world = hosts * per_host
    host = [(r % hosts) if interleaved else (r // per_host) for r in range(world)]
    devices = tuple(DeviceInfo(r, 0, f"h{host[r]}", "cpu", 0) for r in range(world))
    links = tuple(
        Link(a, b, LinkProfile(1.0, 50.0, "shm", "measured"))
        for a in range(world)
        for b in range(a + 1, world)
        if host[a] == host[b]
    )
    return Topology(devices, links, (), LinkProfile(inter_gbps, 200.0, "network", "measured"))


def test_layout_groups_ranks_by_host_name_not_by_number() -> None:
    layout = HostLayout.of(cluster(2, 2, 0.025))
    assert layout.hosts == ((0, 2), (1, 3))
    assert layout.ring_order() == (0, 2, 1, 3) == best_ring(layout)
    assert layout.cross_groups() == [(0, 1), (2, 3)]
    assert layout.crossings(layout.rank_order()) == 2  # every edge of 0-1-2-3 crosses
    assert layout.crossings(layout.ring_order()) == 1


def test_flat_ring_of_interleaved_ranks_is_predicted_twice_the_ordered_ring() -> None:
    model = CostModel.from_topology(cluster(2, 2, 0.025))
    flat = model.predict("flat", 8 * MIB).seconds
    ordered = model.predict("ordered", 8 * MIB).seconds
    assert flat == pytest.approx(2 * ordered, rel=0.01)
    # 6 steps of 2 MiB at 25 MB/s, one crossing per uplink: ~0.5 s (measured 524-608 ms)
    assert ordered == pytest.approx(6 * (2e-4 + 2 * MIB / 25e6), rel=0.02)


def test_hierarchical_moves_the_minimum_across_hosts() -> None:
    model = CostModel.from_topology(cluster(2, 2, 0.025))
    _, inter, _ = model.phases(8 * MIB)
    # each uplink carries n/2 bytes twice (reduce-scatter + all-gather across 2 hosts)
    assert inter == pytest.approx(2 * (2e-4 + 8 * MIB / 2 / 25e6), rel=0.01)
    assert (
        model.predict("hierarchical", 8 * MIB).seconds < model.predict("ordered", 8 * MIB).seconds
    )


def test_pipelining_hides_the_intra_host_phases_when_they_matter() -> None:
    model = CostModel.from_topology(cluster(2, 2, 0.1))
    pipelined = model.predict("pipelined", 16 * MIB)
    assert pipelined.chunks > 1
    assert pipelined.seconds < model.predict("hierarchical", 16 * MIB).seconds


@pytest.mark.parametrize(
    ("topology", "missing"),
    [
        (cluster(1, 4, 0.1), {"hierarchical", "pipelined"}),  # one host
        (cluster(4, 1, 0.1), {"hierarchical", "pipelined"}),  # one rank per host
        (cluster(2, 2, 0.1), set()),
    ],
)
def test_availability_depends_on_the_layout(topology: Topology, missing: set[str]) -> None:
    model = CostModel.from_topology(topology)
    unavailable = unavailable_algorithms(model.layout, "gloo", whole_job=True)
    assert set(unavailable) == missing
    assert all(model.predict(a, MIB).available == (a not in missing) for a in ALGORITHMS)


def test_uneven_hosts_and_subgroups_fall_back_with_the_reason() -> None:
    uneven = Topology(
        tuple(DeviceInfo(r, 0, "ab"[r > 0], "cpu", 0) for r in range(3)),
        (),
        (),
        LinkProfile(0.1, 100.0, "network"),
    )
    layout = CostModel.from_topology(uneven).layout
    assert (
        "different numbers of ranks [1, 2]"
        in unavailable_algorithms(layout, "gloo", True)["hierarchical"]
    )
    model = CostModel.from_topology(cluster(2, 2, 0.1))
    part = unavailable_algorithms(model.layout, "gloo", whole_job=False)
    choice = choose_algorithm(model, 8 * MIB, "hierarchical", part)
    assert choice.algorithm == "flat" and "whole job" in choice.fallback_reason
    nccl = unavailable_algorithms(model.layout, "nccl", whole_job=True)
    assert "orders its own rings" in nccl["ordered"]


def test_auto_choice_is_deterministic_and_prefers_the_simpler_on_ties() -> None:
    model = CostModel.from_topology(cluster(2, 2, 0.025))
    picks = {choose_algorithm(model, 8 * MIB, "auto", {}).algorithm for _ in range(3)}
    assert picks <= {"hierarchical", "pipelined"} and len(picks) == 1
    # ranks already in host order: `ordered` is the flat ring, a tie the simpler wins
    same = CostModel.from_topology(cluster(2, 2, 0.025, interleaved=False))
    assert same.predict("ordered", MIB).seconds == same.predict("flat", MIB).seconds
    assert same.choose(MIB, ("flat", "ordered")).algorithm == "flat"
    one_host = CostModel.from_topology(cluster(1, 4, 0.025))
    assert one_host.choose(64 * MIB).algorithm == "flat"
    # latency-bound: the hierarchy's 4 steps beat the ring's 6 even on equal links
    equal = CostModel(same.layout, LinkCost(1e-5, 1e-12), LinkCost(1e-5, 1e-12))
    assert equal.choose(4096).algorithm == "hierarchical"
    with pytest.raises(ConfigError, match="algorithm='ring'"):
        choose_algorithm(model, MIB, "ring", {})


def test_sharded_collectives_go_hierarchical_across_a_slow_link_only() -> None:
    slow = CostModel.from_topology(cluster(2, 2, 0.025))
    flat, hier = slow.sharded("flat", 8 * MIB), slow.sharded("hierarchical", 8 * MIB)
    assert flat == pytest.approx(slow.predict("flat", 8 * MIB).seconds / 2)
    assert hier < flat / 2  # 1/L of the buffer crosses, once per uplink
    choice = choose_sharded_algorithm(slow, 8 * MIB, "auto", {})
    assert choice.algorithm == "hierarchical" and dict(choice.predictions)["flat"] == flat
    one_host = CostModel.from_topology(cluster(1, 4, 0.025))
    why = unavailable_algorithms(one_host.layout, "gloo", whole_job=True)
    assert choose_sharded_algorithm(one_host, 8 * MIB, "auto", why).algorithm == "flat"
    forced = choose_sharded_algorithm(one_host, 8 * MIB, "hierarchical", why)
    assert forced.algorithm == "flat" and "one host" in forced.fallback_reason
    with pytest.raises(ConfigError, match="algorithm='ordered' is not one of"):
        choose_sharded_algorithm(slow, MIB, "ordered", {})


def test_ring_bottleneck_counts_the_edges_sharing_an_uplink() -> None:
    topology = cluster(2, 2, 0.1)
    assert ring_bottleneck_gbps(topology, (0, 1, 2, 3)) == pytest.approx(0.05)
    assert ring_bottleneck_gbps(topology, (0, 2, 1, 3)) == pytest.approx(0.1)


def test_topo_place_prints_the_topology_order_and_the_gain(tmp_path: Path) -> None:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(two_hosts_interleaved()))
    out = subprocess.run(
        [sys.executable, "-m", "lamina.cli.main", "topo", "place", str(path), "--bytes", "8M"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "order: 0 2 1 3" in out
    gain = float(out.split("predicted gain: ")[1].split("x")[0])
    assert math.isclose(gain, 2.0, rel_tol=0.05)
    ordered = tmp_path / "ordered.json"
    ordered.write_text(json.dumps(two_hosts_of_two()))
    assert topology_from_dict(two_hosts_of_two()).world_size == 4
    out = subprocess.run(
        [sys.executable, "-m", "lamina.cli.main", "topo", "place", str(ordered)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "nothing to gain" in out


def test_bench_rejects_an_unknown_algorithm_before_launching() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lamina.cli.main", "bench", "collectives", "--algorithm", "ring"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "--algorithm ['ring'] unknown" in result.stderr


def test_calibration_fit_recovers_alpha_and_beta_of_a_phase() -> None:
    from lamina.comm.calibrate import fit

    truth = LinkCost(3e-4, 4e-8)
    # a 2-host inter phase with 2 flows per uplink: 2 steps of size x 2/2 bytes each
    points = [(n, 2 * truth.time(n * 2 / 2)) for n in (1 * MIB, 4 * MIB)]
    got = fit(points, steps=2, bytes_per_step=2 / 2)
    assert got.alpha_s == pytest.approx(truth.alpha_s)
    assert got.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte)
    noisy = fit([(MIB, 0.001), (4 * MIB, 0.0009)], steps=2, bytes_per_step=0.5)
    assert noisy.alpha_s > 0 and noisy.beta_s_per_byte > 0  # noise never gives negatives
