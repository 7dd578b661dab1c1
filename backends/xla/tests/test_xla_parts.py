"""The XLA backend's parsing and decision logic; runs with or without torch_xla.

Topology tests use recorded PJRT device attributes: ``[{'name': 'CPU:0'}]`` is what
torch_xla 2.9 reports on PJRT CPU here; the TPU ones follow the attribute names torch_xla
reads (``coords``, ``core_on_chip``, ``slice_index``) on a v5e 2x4 host, the shape the
Cloud TPU v5e documentation lists for an 8-chip VM.
"""

from __future__ import annotations

import pytest
import torch

from lamina.device.topology import HostTopology, merge_host_topologies
from lamina_xla import probe
from lamina_xla.backend import XlaBackend
from lamina_xla.handle import (
    RNG_STATE_BYTES,
    decode_rng_state,
    encode_rng_state,
    memory_stats_from_info,
)
from lamina_xla.topology import (
    ICI_SPECS,
    ici_neighbours,
    parse_device_attributes,
    xla_host_topology,
)

BASE = HostTopology(
    host="tpu-vm-0",
    device_type="cpu",
    local_rank=0,
    device_index=0,
    numa_node=0,
    numa_cpus={0: "0-111"},
    notes=("1 NUMA node(s) from /sys", "process may run on 112 CPU(s), mostly on NUMA node 0"),
)

V5E_2X4 = [{"name": f"TPU:{i}", "coords": [i % 2, i // 2, 0], "core_on_chip": 0} for i in range(8)]


# -- probe ---------------------------------------------------------------------------------
def test_release_parsing() -> None:
    assert probe.release("2.9.0+cu128") == (2, 9, 0)
    assert probe.release("2.13") == (2, 13, 0)
    assert probe.release("nightly") is None
    assert probe.release_text("2.9.0+cu128") == "2.9.0"


def test_missing_reason_names_the_matching_release() -> None:
    reason = probe.missing_reason("2.13.0+cpu")
    assert reason.startswith("torch_xla is not installed; pip install torch_xla==2.13.0 ")
    assert "torch 2.13.0+cpu is installed" in reason
    assert "pip install torch==2.9.0 torch_xla==2.9.0" in probe.missing_reason(None)


def test_version_mismatch() -> None:
    assert probe.version_mismatch("2.9.0+cu128", "2.9.0") is None
    assert probe.version_mismatch(None, "2.9.0") is None
    reason = probe.version_mismatch("2.13.0", "2.9.0")
    assert reason is not None
    assert reason.startswith("torch_xla 2.9.0 needs torch 2.9.x but torch 2.13.0 is installed")
    assert "pip install torch==2.9.0" in reason


@pytest.mark.parametrize(
    ("choice", "refused"),
    [
        (probe.PjrtChoice("CPU", explicit=True), None),
        (probe.PjrtChoice("TPU", explicit=False), None),
        (probe.PjrtChoice("CPU", explicit=False), "PJRT_DEVICE is not set and torch_xla found"),
        (probe.PjrtChoice(None, explicit=False), "PJRT_DEVICE is not set (and"),
    ],
)
def test_unset_pjrt_device(choice: probe.PjrtChoice, refused: str | None) -> None:
    reason = probe.unset_reason(choice)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(refused)
        assert "PJRT_DEVICE=TPU" in reason


def test_availability_without_torch_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "find_torch_xla", lambda: False)
    availability = XlaBackend().availability()
    assert not availability.available
    assert availability.reason.startswith("torch_xla is not installed; pip install torch_xla==")


def test_backend_identity() -> None:
    backend = XlaBackend()
    assert (backend.name, backend.priority, backend.device_type) == ("xla", 90, "xla")
    assert backend.collective_backend == "xla"
    assert set(backend.vendor_versions()) <= {"torch_xla", "libtpu"}


# -- RNG and memory ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1234, 2**40 + 7, 2**64 - 1])
def test_rng_state_round_trip(seed: int) -> None:
    state = encode_rng_state(seed)
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    assert state.numel() == RNG_STATE_BYTES
    assert decode_rng_state(state) == seed


def test_rng_state_rejects_foreign_tensors() -> None:
    with pytest.raises(ValueError, match="uint8 tensor"):
        decode_rng_state(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="must hold 8 bytes"):
        decode_rng_state(torch.zeros(5000, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        encode_rng_state(-1)


def test_memory_stats_from_info() -> None:
    none = memory_stats_from_info(None)
    assert (none.allocated, none.reserved, none.peak, none.scope) == (None, None, None, "device")
    info = {"bytes_used": "290816", "bytes_limit": 34088157184, "peak_bytes_used": 500816}
    stats = memory_stats_from_info(info)
    assert (stats.allocated, stats.reserved, stats.peak) == (290816, None, 500816)


# -- topology ------------------------------------------------------------------------------
def test_parse_attributes() -> None:
    chip = parse_device_attributes({"name": "TPU:5", "coords": [1, 2, 0], "core_on_chip": 0})
    assert (chip.ordinal, chip.coords, chip.core_on_chip, chip.slice_index) == (
        5,
        (1, 2, 0),
        0,
        None,
    )
    cpu = parse_device_attributes({"name": "CPU:0"})
    assert cpu.coords is None
    with pytest.raises(ValueError, match="no 'TYPE:N' name"):
        parse_device_attributes({"coords": [0, 0, 0]})


def test_neighbours_need_one_hop_in_one_slice() -> None:
    a, b, c = (parse_device_attributes(V5E_2X4[i]) for i in (0, 1, 3))
    assert ici_neighbours(a, b) and not ici_neighbours(a, c)
    other_slice = parse_device_attributes({**V5E_2X4[1], "slice_index": 1})
    assert not ici_neighbours(
        parse_device_attributes({**V5E_2X4[0], "slice_index": 0}), other_slice
    )
    core0 = parse_device_attributes({"name": "TPU:0", "coords": [0, 0, 0], "core_on_chip": 0})
    core1 = parse_device_attributes({"name": "TPU:1", "coords": [0, 0, 0], "core_on_chip": 1})
    assert not ici_neighbours(core0, core1)


def test_pjrt_cpu_is_one_host_without_interconnect() -> None:
    piece = xla_host_topology(
        BASE,
        pjrt_device_type="CPU",
        device_kind="cpu",
        local=["CPU:0"],
        own_index=0,
        first_index=0,
        attributes=[{"name": "CPU:0"}],
    )
    assert (piece.device_type, piece.device_index, piece.host) == ("xla", 0, "tpu-vm-0")
    assert piece.local_links == () and piece.intra_host_default == BASE.intra_host_default
    assert any("PJRT CPU: one host" in note for note in piece.notes)


def test_v5e_host_links_neighbouring_chips_over_ici() -> None:
    local = [str(a["name"]) for a in V5E_2X4]
    pieces = [
        xla_host_topology(
            BASE,
            pjrt_device_type="TPU",
            device_kind="TPU v5 lite",
            local=local,
            own_index=i,
            first_index=0,
            attributes=V5E_2X4,
        )
        for i in range(8)
    ]
    first = pieces[0]
    assert len(first.local_links) == 10  # a 2x4 grid has 6 + 4 edges
    profile = first.intra_host_default
    assert (profile.kind, profile.source, profile.bandwidth_gbps) == ("ici", "estimated", 50.0)
    assert all(link.profile == profile for link in first.local_links)
    assert any("coords (0, 0, 0)" in note for note in first.notes)
    topology = merge_host_topologies(pieces)
    assert topology.link(0, 1).kind == "ici" and topology.link(0, 7).kind == "ici"
    assert [d.device_index for d in topology.devices] == list(range(8))


def test_process_per_chip_uses_host_index() -> None:
    piece = xla_host_topology(
        BASE,
        pjrt_device_type="TPU",
        device_kind="TPU v5",
        local=["TPU:6"],
        own_index=0,
        first_index=2,
        attributes=V5E_2X4,
    )
    assert piece.device_index == 2 and piece.local_links == ()
    assert piece.intra_host_default == ICI_SPECS["TPU v5"].link()
    assert piece.intra_host_default.bandwidth_gbps == 100.0


def test_unknown_tpu_kind_uses_smallest_known_figure() -> None:
    piece = xla_host_topology(
        BASE,
        pjrt_device_type="TPU",
        device_kind="TPU v4",
        local=["TPU:0"],
        own_index=0,
        first_index=0,
        attributes=V5E_2X4,
    )
    assert piece.intra_host_default.kind == "ici"
    assert piece.intra_host_default.bandwidth_gbps == 50.0
    assert any("no published ICI figure known for 'TPU v4'" in n for n in piece.notes)
    with pytest.raises(ValueError, match="own_index 3"):
        xla_host_topology(
            BASE,
            pjrt_device_type="TPU",
            device_kind="TPU v4",
            local=["TPU:0"],
            own_index=3,
            first_index=0,
            attributes=V5E_2X4,
        )
