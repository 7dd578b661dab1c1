"""NVML topology: recorded machine shapes, the pure logic, and the live query path."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lamina.device.topology import merge_host_topologies
from lamina_cuda.nvml_source import (
    NvmlAnswers,
    NvmlUnavailableError,
    answers_from_dict,
    answers_to_dict,
    cpulist_from_masks,
    load_answers,
    normalize_bus_id,
    query_nvml,
    save_answers,
)
from lamina_cuda.nvml_topology import (
    CudaDeviceId,
    discover_host_topology,
    host_topology_from_answers,
    nvlink_per_link_gbps,
    pcie_gbps,
    pcie_only_host_topology,
)

H100_NV18 = round(18 * 20.6, 3)


def _links(answers: NvmlAnswers, **kwargs: object) -> dict[tuple[int, int], tuple[str, float, str]]:
    piece = host_topology_from_answers(answers, 0, host="h", **kwargs)  # type: ignore[arg-type]
    return {
        (x.index_a, x.index_b): (x.profile.kind, x.profile.bandwidth_gbps, x.profile.source)
        for x in piece.local_links
    }


# --------------------------------------------------------------------------- DGX H100


def test_dgx_h100_every_pair_is_nv18_through_nvswitch(dgx_h100: NvmlAnswers) -> None:
    links = _links(dgx_h100)
    assert len(links) == 28
    assert set(links.values()) == {("nvlink", H100_NV18, "discovered")}


def test_dgx_h100_is_one_fast_group_with_numa_split(dgx_h100: NvmlAnswers) -> None:
    pieces = [host_topology_from_answers(dgx_h100, r, host="dgx") for r in range(8)]
    assert all(p.fast_groups == (tuple(range(8)),) for p in pieces)
    assert [p.numa_node for p in pieces] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [p.device_index for p in pieces] == list(range(8))
    assert pieces[0].numa_cpus == {0: "0-51", 1: "52-103"}


def test_dgx_h100_merged_topology_has_one_fast_domain(dgx_h100: NvmlAnswers) -> None:
    pieces = [host_topology_from_answers(dgx_h100, r, host="dgx") for r in range(8)]
    topology = merge_host_topologies(pieces)
    assert [(d.name, d.ranks) for d in topology.fast_domains] == [("dgx/0", tuple(range(8)))]
    assert topology.link(0, 7).kind == "nvlink"
    assert topology.link(3, 4).bandwidth_gbps == H100_NV18  # across sockets, still NVLink


def test_nvswitch_links_found_by_bus_id_without_remote_type(dgx_h100: NvmlAnswers) -> None:
    gpus = tuple(
        replace(g, nvlinks=tuple(replace(x, remote_type=None) for x in g.nvlinks))
        for g in dgx_h100.gpus
    )
    links = _links(replace(dgx_h100, gpus=gpus))
    assert set(links.values()) == {("nvlink", H100_NV18, "discovered")}


def test_visible_subset_is_renumbered_by_uuid(dgx_h100: NvmlAnswers) -> None:
    # CUDA_VISIBLE_DEVICES=5,2: CUDA device 0 is NVML GPU 5 (NUMA 1), device 1 is GPU 2.
    visible = [CudaDeviceId(uuid=dgx_h100.gpus[k].uuid) for k in (5, 2)]
    piece = host_topology_from_answers(dgx_h100, 0, visible=visible, host="dgx")
    assert piece.device_index == 0 and piece.numa_node == 1
    assert [(x.index_a, x.index_b) for x in piece.local_links] == [(0, 1)]
    assert piece.fast_groups == ((0, 1),)


def test_visible_matched_by_bus_id(pcie_4gpu: NvmlAnswers) -> None:
    visible = [CudaDeviceId(bus_id="00000000:B1:00.0"), CudaDeviceId(bus_id="0000:b2:00.0")]
    piece = host_topology_from_answers(pcie_4gpu, 1, visible=visible, host="s")
    assert piece.numa_node == 1
    assert piece.local_links[0].profile.kind == "pcie"


# --------------------------------------------------------------------------- PCIe server


def test_pcie_server_links_per_pair(pcie_4gpu: NvmlAnswers) -> None:
    links = _links(pcie_4gpu)
    same_switch = ("pcie", 24.0, "discovered")  # Gen4 x16
    cross_socket = ("shm", 10.0, "estimated")
    assert links == {
        (0, 1): same_switch,
        (2, 3): same_switch,
        (0, 2): cross_socket,
        (0, 3): cross_socket,
        (1, 2): cross_socket,
        (1, 3): cross_socket,
    }


def test_pcie_server_groups_by_switch_and_numa(pcie_4gpu: NvmlAnswers) -> None:
    pieces = [host_topology_from_answers(pcie_4gpu, r, host="srv") for r in range(4)]
    assert pieces[0].fast_groups == ((0, 1), (2, 3))
    assert [p.numa_node for p in pieces] == [0, 0, 1, 1]
    assert pieces[0].numa_cpus == {0: "0-15", 1: "16-31"}


def test_pcie_server_merged_eight_ranks(pcie_4gpu: NvmlAnswers) -> None:
    # 8 ranks on one 4-GPU host: local rank r uses GPU r % 4.
    pieces = [host_topology_from_answers(pcie_4gpu, r, host="srv") for r in range(8)]
    topology = merge_host_topologies(pieces)
    assert [d.ranks for d in topology.fast_domains] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert topology.link(0, 1).bandwidth_gbps == 24.0
    assert topology.link(1, 2).kind == "shm"


def test_numa_from_affinity_when_nvml_has_no_numa_id(pcie_4gpu: NvmlAnswers) -> None:
    gpus = tuple(replace(g, numa_node=None) for g in pcie_4gpu.gpus)
    piece = host_topology_from_answers(
        replace(pcie_4gpu, gpus=gpus), 3, host="srv", numa_cpus={0: "0-15", 1: "16-31"}
    )
    assert piece.numa_node == 1


# --------------------------------------------------------------------------- figures


def test_per_link_figures_by_version_and_sm() -> None:
    assert nvlink_per_link_gbps(4, None)[0] == 20.0  # NVLink 3.0 (A100)
    assert nvlink_per_link_gbps(6, None)[0] == 20.6  # NVLink 4.0 (H100)
    assert nvlink_per_link_gbps(7, None)[0] == 40.1  # NVLink 5.0 (B200)
    assert nvlink_per_link_gbps(None, 9)[0] == 20.6
    assert nvlink_per_link_gbps(None, None)[0] == 20.0


def test_pcie_figures_scale_with_gen_and_width() -> None:
    assert pcie_gbps(3, 16) == 12.0
    assert pcie_gbps(4, 16) == 24.0
    assert pcie_gbps(5, 8) == 24.0
    assert pcie_gbps(None, 16) is None


def test_direct_nvlink_pair_without_switch(pcie_4gpu: NvmlAnswers) -> None:
    from lamina_cuda.nvml_source import NvLinkAnswer

    # An NVLink bridge (4 links, NVLink 3.0) joins GPU0 and GPU1 of the PCIe server.
    g0, g1 = pcie_4gpu.gpus[0], pcie_4gpu.gpus[1]
    bridge0 = tuple(NvLinkAnswer(k, True, 4, g1.bus_id, "gpu") for k in range(4))
    bridge1 = tuple(NvLinkAnswer(k, True, 4, g0.bus_id, "gpu") for k in range(4))
    gpus = (replace(g0, nvlinks=bridge0), replace(g1, nvlinks=bridge1), *pcie_4gpu.gpus[2:])
    links = _links(replace(pcie_4gpu, gpus=gpus))
    assert links[(0, 1)] == ("nvlink", 80.0, "discovered")
    assert links[(2, 3)][0] == "pcie"
    piece = host_topology_from_answers(replace(pcie_4gpu, gpus=gpus), 0, host="srv")
    assert piece.fast_groups == ((0, 1), (2, 3))


# --------------------------------------------------------------------------- data


def test_answers_json_round_trip(dgx_h100: NvmlAnswers, tmp_path: Path) -> None:
    path = tmp_path / "answers.json"
    save_answers(dgx_h100, path)
    assert load_answers(path) == dgx_h100
    assert answers_from_dict(answers_to_dict(dgx_h100)) == dgx_h100


def test_bad_level_names_the_entry(pcie_4gpu: NvmlAnswers) -> None:
    data = answers_to_dict(pcie_4gpu)
    data["common_ancestor"][0][2] = "SAME_PLANET"
    with pytest.raises(ValueError, match=r"common_ancestor\[0\].*SAME_PLANET"):
        answers_from_dict(data)


def test_bus_id_and_cpulist_helpers() -> None:
    assert normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert normalize_bus_id("1b:00.0") == "0000:1b:00.0"
    with pytest.raises(ValueError, match="bad PCI bus id"):
        normalize_bus_id("gpu0")
    assert cpulist_from_masks([0b1111, 0]) == "0-3"
    assert cpulist_from_masks([(1 << 64) - 1, 0b1]) == "0-64"
    assert cpulist_from_masks([0b1011]) == "0-1,3"
    assert cpulist_from_masks([0]) == ""


# --------------------------------------------------------------------------- live path


def _nvml_absent_reason() -> str | None:
    try:
        query_nvml()
    except NvmlUnavailableError as exc:
        return str(exc)
    return None


def test_live_query_without_driver_reports_nvml_absent() -> None:
    reason = _nvml_absent_reason()
    if reason is None:
        pytest.skip("NVML answers on this host (a driver is installed)")
    assert reason.strip()
    piece = discover_host_topology(0, 1)
    assert piece.device_type == "cuda"
    assert piece.notes[0] == f"NVML not available ({reason}): topology is PCIe-only estimates"
    assert piece.local_links == () and piece.fast_groups == ()
    assert piece.intra_host_default.kind == "pcie"
    assert piece.intra_host_default.source == "estimated"


def test_live_query_with_driver_lists_the_gpus() -> None:
    if _nvml_absent_reason() is not None:
        pytest.skip(f"NVML not available here: {_nvml_absent_reason()}")
    answers = query_nvml()
    assert answers.gpus and all(g.bus_id for g in answers.gpus)
    piece = discover_host_topology(0, len(answers.gpus))
    assert piece.fast_groups and piece.device_type == "cuda"


def test_missing_nvidia_ml_py_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(NvmlUnavailableError, match="nvidia-ml-py is not installed"):
        query_nvml()
    piece = pcie_only_host_topology(2, "nvidia-ml-py is not installed", host="h")
    assert piece.device_index == 2
    assert "NVML not available (nvidia-ml-py is not installed)" in piece.notes[0]
