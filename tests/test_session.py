"""lamina.init(): environment parsing, single process, real ranks over gloo, meshes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lamina
from lamina.device.topology import Topology
from lamina.device.topology_file import load_topology, save_topology, topology_from_dict
from lamina.errors import ConfigError, MeshError
from lamina.session import LaunchEnv
from lamina.testing import RankFailure, run_ranks
from topologies_for_tests import two_hosts_of_two

pytestmark = pytest.mark.portable


def test_single_process_init_is_idempotent_and_shuts_down() -> None:
    runtime = lamina.init()
    assert (runtime.rank, runtime.world_size, runtime.device) == (0, 1, torch.device("cpu"))
    assert runtime.backend.name == "cpu" and dist.get_backend() == "gloo"
    assert lamina.init() is runtime
    assert runtime.mesh.axis_names == ("dp",) and runtime.mesh.shape == (1,)
    assert runtime.topology.world_size == 1
    assert runtime.kernels.implementation_name("pack_bucket") == "cpu"
    lamina.shutdown()
    assert not dist.is_initialized() and lamina.current() is None


def test_init_with_other_backend_after_init_is_an_error() -> None:
    lamina.init()
    with pytest.raises(ConfigError, match="already initialized"):
        lamina.init(backend="cuda")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
        ({"RANK": "two", "WORLD_SIZE": "2"}, "RANK='two' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside WORLD_SIZE=2"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK=3 is outside LOCAL_WORLD_SIZE=2",
        ),
    ],
)
def test_bad_launch_environment_is_named(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LaunchEnv.from_environ(environ)


def test_multi_rank_env_without_master_addr_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set"):
        lamina.init()


def _all_reduce_through_init() -> dict[str, object]:
    runtime = lamina.init()
    tensor = torch.full((8,), float(runtime.rank + 1))
    dist.all_reduce(tensor)
    return {
        "sum": tensor.tolist(),
        "world": runtime.world_size,
        "backend": dist.get_backend(),
        "topology_ranks": runtime.topology.world_size,
        "hosts": runtime.topology.hosts(),
    }


#: Rounds of init, all-reduce, shutdown: with a store per init, about 1 re-init in 3 hung
#: (a rank reached rank 0's old store before it closed), so 6 rounds all but always hit it.
REINIT_ROUNDS = 6


def _init_again_after_shutdown() -> list[float]:
    sums = []
    for round_ in range(REINIT_ROUNDS):
        # a different mesh each round: a rank that read the previous group's keys would
        # disagree on it, or wait for ranks that are elsewhere
        runtime = lamina.init(mesh="flat" if round_ % 2 else "topology")
        tensor = torch.full((4,), float(runtime.rank + 1 + round_))
        dist.all_reduce(tensor)
        sums.append(tensor[0].item())
        lamina.shutdown()
        assert not dist.is_initialized()
    return sums


@pytest.mark.multiprocess
def test_init_again_after_shutdown_joins_a_new_group_every_time() -> None:
    results = run_ranks(_init_again_after_shutdown, 2, timeout=120)
    expected = [float(3 + 2 * round_) for round_ in range(REINIT_ROUNDS)]
    assert results == [expected, expected]


@pytest.mark.multiprocess
def test_two_rank_gloo_all_reduce_through_init() -> None:
    results = run_ranks(_all_reduce_through_init, 2, timeout=120)
    for result in results:
        assert result["sum"] == [3.0] * 8
        assert result["world"] == 2 and result["backend"] == "gloo"
        assert result["topology_ranks"] == 2 and len(result["hosts"]) == 1  # type: ignore[arg-type]


TWO_BY_TWO = two_hosts_of_two()


def _mesh_from_declared_topology() -> dict[str, object]:
    runtime = lamina.init(mesh="topology")
    mesh = runtime.mesh
    intra = torch.tensor([float(runtime.rank)])
    dist.all_reduce(intra, group=mesh.group("intra"))
    inter = torch.tensor([float(runtime.rank)])
    dist.all_reduce(inter, group=mesh.group("inter"))
    return {
        "axes": mesh.axis_names,
        "shape": mesh.shape,
        "coords": mesh.coordinates(),
        "grid": mesh.ranks(),
        "intra_sum": intra.item(),
        "inter_sum": inter.item(),
        "host": runtime.topology.device(runtime.rank).host,
    }


@pytest.mark.multiprocess
def test_mesh_factorized_from_two_hosts_by_two_ranks(tmp_path: Path) -> None:
    path = tmp_path / "two_by_two.json"
    path.write_text(json.dumps(TWO_BY_TWO))
    results = run_ranks(
        _mesh_from_declared_topology, 4, env={"LAMINA_TOPOLOGY": str(path)}, timeout=150
    )
    for rank, result in enumerate(results):
        assert result["axes"] == ("inter", "intra")
        assert result["shape"] == (2, 2)
        assert result["grid"] == [[0, 1], [2, 3]]
        assert result["coords"] == {"inter": rank // 2, "intra": rank % 2}
        # intra groups {0,1} and {2,3}; inter groups {0,2} and {1,3}
        assert result["intra_sum"] == {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}[rank]
        assert result["inter_sum"] == {0: 2.0, 1: 4.0, 2: 2.0, 3: 4.0}[rank]
        assert result["host"] == ("node-a" if rank < 2 else "node-b")


def test_factorization_follows_domains_not_rank_order() -> None:
    from lamina.device.mesh import factorize_topology

    crossed = dict(TWO_BY_TWO)
    crossed["links"] = []
    crossed["fast_domains"] = [{"name": "x", "ranks": [1, 3]}, {"name": "y", "ranks": [0, 2]}]
    assert factorize_topology(topology_from_dict(crossed)) == [[0, 2], [1, 3]]


def test_unequal_fast_domains_cannot_form_a_mesh() -> None:
    from lamina.device.mesh import factorize_topology

    lopsided = dict(TWO_BY_TWO)
    lopsided["links"] = []
    lopsided["fast_domains"] = [{"name": "x", "ranks": [0, 1, 2]}, {"name": "y", "ranks": [3]}]
    with pytest.raises(MeshError, match="different sizes"):
        factorize_topology(topology_from_dict(lopsided))


def test_mesh_shape_that_does_not_multiply_to_world_size() -> None:
    with pytest.raises(
        MeshError, match=r"mesh shape \(2, 2\) holds 4 ranks but the world size is 1"
    ):
        lamina.init(mesh=((2, 2), ("a", "b")))


def test_declared_topology_of_wrong_size_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "four.json"
    save_topology(topology_from_dict(TWO_BY_TWO), path)
    with pytest.raises(ConfigError, match="declares 4 ranks but WORLD_SIZE is 1"):
        lamina.init(topology=path)
    assert isinstance(load_topology(path), Topology)


def _rank_one_raises() -> None:
    runtime = lamina.init()
    if runtime.rank == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()


@pytest.mark.multiprocess
def test_harness_forwards_the_failing_rank() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_one_raises, 2, timeout=60)
    assert info.value.rank == 1
    assert "rank one is broken on purpose" in str(info.value)
