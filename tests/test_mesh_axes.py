"""Meshes of up to four named axes: the dict spelling, the tp-placement warning, and
process groups over any subset of axes (4 gloo ranks)."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lamina
from lamina.device.mesh import MAX_MESH_AXES, planned_grid, tp_axis_warning
from lamina.device.topology import DeviceInfo, Topology
from lamina.device.topology_file import topology_from_dict
from lamina.errors import MeshError
from lamina.session import _mesh_axes
from lamina.testing import run_ranks
from topologies_for_tests import two_hosts_interleaved, two_hosts_of_two

pytestmark = pytest.mark.portable

WORLD = 4


def _bare(world: int) -> Topology:
    """``world`` ranks on one host, no fast domains declared."""
    return Topology(tuple(DeviceInfo(r, r, "h", "cpu", r) for r in range(world)))


def test_dict_mesh_is_its_shape_and_names_outermost_first() -> None:
    shape, names = _mesh_axes({"dp": 1, "fsdp": 2, "tp": 2})
    assert (shape, names) == ((1, 2, 2), ("dp", "fsdp", "tp"))
    assert planned_grid(shape, names, _bare(WORLD)) == [[[0, 1], [2, 3]]]
    assert _mesh_axes({"tp": 2, "dp": 2}) == ((2, 2), ("tp", "dp"))


def test_a_dict_of_four_axes_is_accepted() -> None:
    shape, names = _mesh_axes({"pp": 1, "dp": 2, "fsdp": 1, "tp": 2})
    assert planned_grid(shape, names, _bare(WORLD)) == [[[[0, 1]], [[2, 3]]]]


def test_more_than_four_axes_is_refused_in_one_line() -> None:
    spec = {f"a{i}": 1 for i in range(MAX_MESH_AXES + 1)}
    with pytest.raises(MeshError) as info:
        _mesh_axes(spec)
    message = str(info.value)
    assert "mesh has 5 axes" in message and "at most 4" in message
    assert "\n" not in message
    with pytest.raises(MeshError, match="mesh has 5 axes"):  # the tuple spelling too
        planned_grid((1,) * 5, tuple(spec), _bare(1))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "has no axes"),
        ({"dp": "2"}, "mesh axis 'dp' has size '2'"),
        ({"dp": True}, "mesh axis 'dp' has size True"),
    ],
)
def test_bad_dict_entries_are_named(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(MeshError, match=message):
        _mesh_axes(spec)


def test_dict_whose_product_is_not_the_world_size_is_refused() -> None:
    shape, names = _mesh_axes({"dp": 2, "fsdp": 2, "tp": 2})
    with pytest.raises(
        MeshError, match=r"mesh shape \(2, 2, 2\) holds 8 ranks but the world size is 4"
    ):
        planned_grid(shape, names, _bare(WORLD))
    with pytest.raises(
        MeshError, match=r"mesh shape \(2, 2\) holds 4 ranks but the world size is 1"
    ):
        lamina.init(mesh={"dp": 2, "tp": 2})


def test_tp_outermost_across_two_hosts_is_warned_with_ranks_domains_and_fix() -> None:
    topo = topology_from_dict(two_hosts_of_two())
    grid = planned_grid((2, 2), ("tp", "dp"), topo)
    message = tp_axis_warning(grid, ("tp", "dp"), topo)
    assert message is not None and "\n" not in message
    assert 'mesh axis "tp" group [0, 2]' in message
    assert "'node-a' and 'node-b'" in message
    assert 'put "tp" last (innermost)' in message and "at most 2 ranks" in message


def test_tp_wider_than_a_host_is_warned() -> None:
    topo = topology_from_dict(two_hosts_of_two())
    message = tp_axis_warning(planned_grid((4,), ("tp",), topo), ("tp",), topo)
    assert message is not None
    assert "group [0, 1, 2, 3]" in message and "(ranks 1 and 2)" in message


def test_tp_innermost_on_an_interleaved_launch_is_warned() -> None:
    topo = topology_from_dict(two_hosts_interleaved())
    grid = planned_grid((2, 2), ("dp", "tp"), topo)
    message = tp_axis_warning(grid, ("dp", "tp"), topo)
    assert message is not None and "group [0, 1]" in message


@pytest.mark.parametrize(
    ("shape", "names", "topology"),
    [
        ((1, 2, 2), ("dp", "fsdp", "tp"), two_hosts_of_two()),  # tp inside each host
        ((2, 2), ("tp", "dp"), None),  # no fast domains declared
        ((2, 2), ("fsdp", "dp"), two_hosts_interleaved()),  # no tp axis
    ],
)
def test_tp_inside_fast_domains_or_nothing_to_check_is_not_warned(
    shape: tuple[int, ...], names: tuple[str, ...], topology: dict[str, Any] | None
) -> None:
    topo = _bare(WORLD) if topology is None else topology_from_dict(topology)
    assert tp_axis_warning(planned_grid(shape, names, topo), names, topo) is None


def _subset_groups_job() -> dict[str, Any]:
    runtime = lamina.init(mesh={"dp": 1, "fsdp": 2, "tp": 2})
    mesh, rank = runtime.mesh, runtime.rank
    result: dict[str, Any] = {"grid": mesh.ranks()}
    for axes in (("dp", "fsdp"), ("tp",), ("dp", "tp"), ("tp", "fsdp")):
        group, ranks = mesh.group_over(axes)
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        again = mesh.group_over(axes)
        result["+".join(axes)] = {
            "ranks": ranks,
            "sum": value.item(),
            "same": again[0] is group and again[1] == ranks,
        }
    result["all"] = mesh.group_over(("tp", "dp", "fsdp"))
    result["submesh"] = {
        "fsdp+tp": mesh.submesh(("tp", "fsdp")).mesh.tolist(),
        "tp": mesh.submesh(("tp",)).mesh.tolist(),
        "tp_names": mesh.submesh(("tp",)).mesh_dim_names,
    }
    return result


def _tp_outermost_job() -> dict[str, Any]:
    """A 4-axis mesh with tp outermost: warned at init; groups over axes that are not
    neighbours in the mesh."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime = lamina.init(mesh={"tp": 2, "pp": 1, "fsdp": 2, "ep": 1})
    mesh = runtime.mesh
    return {
        "warnings": [str(w.message) for w in caught if 'axis "tp"' in str(w.message)],
        "tp+ep": mesh.group_over(("ep", "tp"))[1],
        "pp+fsdp": mesh.group_over(("pp", "fsdp"))[1],
    }


@pytest.fixture(scope="module")
def topology_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("mesh_axes") / "two_hosts_of_two.json"
    path.write_text(json.dumps(two_hosts_of_two()))
    return str(path)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_groups_over_any_subset_of_a_three_axis_mesh(topology_file: str) -> None:
    results = run_ranks(
        _subset_groups_job, WORLD, env={"LAMINA_TOPOLOGY": topology_file}, timeout=45
    )
    for rank, result in enumerate(results):
        assert result["grid"] == [[[0, 1], [2, 3]]]
        host = (rank // 2 * 2, rank // 2 * 2 + 1)
        expected = {
            "dp+fsdp": (rank % 2, rank % 2 + 2),  # the ranks sharing this rank's tp coordinate
            "tp": host,
            "dp+tp": host,  # dp has size 1
            "tp+fsdp": (0, 1, 2, 3),  # a flattened group, though it spans every rank
        }
        for label, ranks in expected.items():
            got = result[label]
            assert got["ranks"] == ranks, (rank, label, got)
            assert got["sum"] == sum(ranks), (rank, label, got)
            assert got["same"], (rank, label)
        assert result["all"] == (None, (0, 1, 2, 3))
        assert result["submesh"]["fsdp+tp"] == [[0, 1], [2, 3]]
        assert result["submesh"]["tp"] == list(host)
        assert result["submesh"]["tp_names"] == ("tp",)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_init_warns_when_tp_groups_cross_hosts(topology_file: str) -> None:
    results = run_ranks(
        _tp_outermost_job, WORLD, env={"LAMINA_TOPOLOGY": topology_file}, timeout=45
    )
    for rank, result in enumerate(results):
        # tp outermost: tp groups [0, 2] and [1, 3] cross the two hosts
        assert len(result["warnings"]) == 1, result["warnings"]
        assert 'mesh axis "tp" group [0, 2]' in result["warnings"][0]
        assert result["tp+ep"] == (rank % 2, rank % 2 + 2)
        assert result["pp+fsdp"] == (rank // 2 * 2, rank // 2 * 2 + 1)
