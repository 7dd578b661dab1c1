"""The link probe's plan and how measurements become a topology (no processes)."""

from __future__ import annotations

import pytest

from lamina.device.probe import link_rows, probe_pairs, with_measurements
from lamina.device.topology import DeviceInfo, FastDomain, Link, LinkProfile, Topology

pytestmark = pytest.mark.portable

SHM = LinkProfile(10.0, 1.0, "shm", "estimated")


def _interleaved(hosts: int = 3, per_host: int = 2) -> Topology:
    """Ranks numbered round-robin over the hosts, as srun --distribution=cyclic does."""
    devices = tuple(
        DeviceInfo(r, r // hosts, f"h{r % hosts}", "cpu", 0) for r in range(hosts * per_host)
    )
    links = tuple(
        Link(a, b, SHM)
        for a in range(len(devices))
        for b in range(a + 1, len(devices))
        if devices[a].host == devices[b].host
    )
    domains = tuple(
        FastDomain(f"h{h}", tuple(r for r in range(len(devices)) if r % hosts == h))
        for h in range(hosts)
    )
    return Topology(devices, links, domains)


def test_one_pair_per_pair_of_hosts_and_one_inside_each_host() -> None:
    assert probe_pairs(_interleaved()) == [
        (0, 1, "network"), (0, 2, "network"), (1, 2, "network"),
        (0, 3, "intra"), (1, 4, "intra"), (2, 5, "intra"),
    ]  # fmt: skip
    single = _interleaved(hosts=1, per_host=1)
    assert probe_pairs(single) == []


def test_measurements_apply_to_every_rank_pair_of_their_hosts() -> None:
    topology = with_measurements(
        _interleaved(),
        {
            (0, 1): (100.0, 0.025),
            (0, 2): (120.0, 0.020),
            (1, 2): (90.0, 0.030),
            (0, 3): (5.0, 3.0),
        },
    )
    assert topology.link(3, 4) == LinkProfile(0.025, 100.0, "network", "measured")  # h0-h1
    assert topology.link(5, 4).bandwidth_gbps == 0.030  # h2-h1
    assert topology.link(3, 0) == LinkProfile(3.0, 5.0, "shm", "measured")  # kind kept
    assert topology.link(1, 4) == SHM  # h1's inside link was not measured: kept
    assert topology.default_link.bandwidth_gbps == 0.020  # the slowest network pair
    rows = {(a, b): p.bandwidth_gbps for a, b, p in link_rows(topology)}
    assert rows == {
        ("h0", "h1"): 0.025,
        ("h0", "h2"): 0.020,
        ("h1", "h2"): 0.030,
        ("h0", "h0"): 3.0,
    }


def _probed() -> dict[str, object]:
    import lamina

    with lamina.init(topology="probe") as rt:
        link = rt.topology.link(0, 1)
        return {"source": link.source, "kind": link.kind, "gbps": link.bandwidth_gbps}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_init_with_topology_probe_measures_the_links() -> None:
    from lamina.testing import run_ranks

    results = run_ranks(_probed, 2, timeout=90)
    assert results[0] == results[1]  # every rank builds the same measured topology
    assert results[0]["source"] == "measured" and results[0]["kind"] != "network"
    assert float(str(results[0]["gbps"])) > 0


def test_lamina_info_shows_this_hosts_ranks_and_measured_links(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import socket

    from lamina.device.topology_file import save_topology
    from lamina.testing.cli import run_lamina

    here = socket.gethostname()
    devices = tuple(
        DeviceInfo(r, r // 2, here if r % 2 == 0 else "elsewhere", "cpu", 0) for r in range(4)
    )
    base = Topology(devices, (), (FastDomain(here, (0, 2)), FastDomain("elsewhere", (1, 3))))
    measured = with_measurements(base, {(0, 1): (100.0, 0.025), (0, 2): (5.0, 3.0)})
    path = tmp_path / "measured.json"
    save_topology(measured, path)
    result = run_lamina("info", env={"LAMINA_TOPOLOGY": str(path)})
    assert result.returncode == 0, result.stderr
    assert f"job topology {path}: 4 rank(s) on 2 host(s); this host runs rank(s) [0, 2]" in (
        result.stdout
    )
    assert "200.0 Mbit/s, 100.0 us (measured)" in result.stdout
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    shown = run_lamina("info", env={"LAMINA_TOPOLOGY": str(broken)})
    assert f"job topology {broken}:" in shown.stdout and shown.returncode == 0
