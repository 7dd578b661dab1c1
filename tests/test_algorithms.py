"""Every all-reduce algorithm equals the flat all-reduce, and ZeRO-3's hierarchical
gather and reduce-scatter equal the flat ones: exactly on integers, within 1e-6 on
floats; on 4 gloo ranks laid out as 2 hosts x 2, interleaved (and, for the sharded
collectives, also with the hosts' ranks in a row, where the slots are permuted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lamina
from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.layout import HostLayout
from lamina.memory.hierarchy import HostHierarchy
from lamina.testing import run_ranks
from topologies_for_tests import two_hosts_interleaved

WORLD = 4
#: (algorithm, chunks); sizes include ones that need padding to equal shards.
CASES = (("ordered", 1), ("hierarchical", 1), ("pipelined", 2), ("pipelined", 4))
SIZES = (1, 7, 1000, 4099)
#: Host layouts of the sharded collectives: as launched (cyclic), and in a row.
SHARDED_LAYOUTS = {
    "interleaved": HostLayout(("node-a", "node-b"), ((0, 2), (1, 3))),
    "in-a-row": HostLayout(("node-a", "node-b"), ((0, 1), (2, 3))),
}
SHARD_SIZES = (1, 1000)


def _compare_all() -> dict[str, Any]:
    runtime = lamina.init()
    layout = HostLayout.of(runtime.topology)
    groups = AlgorithmGroups(layout, runtime.rank, pg_backend="gloo")
    out: dict[str, Any] = {
        "hosts": [list(h) for h in layout.hosts],
        "unavailable": groups.unavailable,
    }
    for algorithm, chunks in CASES:
        for size in SIZES:
            gen = torch.Generator().manual_seed(1000 * runtime.rank + size)
            ints = torch.randint(-(2**40), 2**40, (size,), generator=gen, dtype=torch.int64)
            floats = torch.randn(size, generator=gen, dtype=torch.float32)
            for name, tensor in (("int64", ints), ("float32", floats)):
                expected = tensor.clone()
                dist.all_reduce(expected)
                got = tensor.clone()
                groups.all_reduce(algorithm, got, chunks).wait()
                key = f"{algorithm}/{chunks}/{size}/{name}"
                if name == "int64":
                    out[key] = bool(torch.equal(got, expected))
                else:
                    out[key] = float((got - expected).abs().max() / expected.abs().max())
    groups.close()
    for name, host_layout in SHARDED_LAYOUTS.items():
        out.update(_compare_sharded(name, host_layout, runtime.rank))
    return out


def _hierarchy(layout: HostLayout, rank: int) -> tuple[AlgorithmGroups, HostHierarchy]:
    groups = AlgorithmGroups(layout, rank, pg_backend="gloo", needed=("hierarchical",))
    return groups, HostHierarchy.for_rank(
        layout.hosts, rank, groups.intra, groups.inter, native=False, worker=groups.worker
    )


def _compare_sharded(name: str, layout: HostLayout, rank: int) -> dict[str, Any]:
    """The hierarchical gather and reduce-scatter (mean) of ``layout`` against the flat
    ones; "integer" tensors hold whole numbers in float64, whose mean over 4 ranks is
    exact, so they must match bit for bit."""
    groups, hierarchy = _hierarchy(layout, rank)
    out: dict[str, Any] = {f"order/{name}": list(hierarchy.order)}
    for size in SHARD_SIZES:
        gen = torch.Generator().manual_seed(7 * rank + size)
        whole = torch.randint(-(2**40), 2**40, (WORLD * size,), generator=gen).double()
        floats = torch.randn(WORLD * size, generator=gen, dtype=torch.float32)
        for dtype, tensor in (("integer", whole), ("float32", floats)):
            summed = tensor.clone()
            dist.all_reduce(summed)
            mine = summed.view(WORLD, size)[rank] / WORLD
            work, result = hierarchy.reduce_scatter_start(tensor.clone())
            work.wait()
            got = result()
            shard = tensor.view(WORLD, size)[rank].clone()
            full = torch.empty_like(tensor)
            hierarchy.gather(shard, full).wait()
            flat = [torch.empty_like(shard) for _ in range(WORLD)]
            dist.all_gather(flat, shard)
            key = f"{name}/{size}/{dtype}"
            if dtype == "integer":
                out[f"scatter/{key}"] = bool(torch.equal(got, mine))
            else:
                out[f"scatter/{key}"] = float((got - mine).abs().max() / mine.abs().max())
            out[f"gather/{key}"] = bool(torch.equal(full, torch.cat(flat)))
    groups.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path: Path = tmp_path_factory.mktemp("algorithms") / "interleaved.json"
    path.write_text(json.dumps(two_hosts_interleaved()))
    return run_ranks(_compare_all, WORLD, env={"LAMINA_TOPOLOGY": str(path)}, timeout=240)


@pytest.mark.timeout(300)
def test_groups_follow_the_hosts_not_the_rank_numbers(results: list[dict[str, Any]]) -> None:
    assert results[0]["hosts"] == [[0, 2], [1, 3]]
    assert results[0]["unavailable"] == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("algorithm", "chunks"), CASES)
@pytest.mark.parametrize("size", SIZES)
def test_every_algorithm_equals_the_flat_all_reduce(
    results: list[dict[str, Any]], algorithm: str, chunks: int, size: int
) -> None:
    for rank, result in enumerate(results):
        assert result[f"{algorithm}/{chunks}/{size}/int64"] is True, rank
        assert result[f"{algorithm}/{chunks}/{size}/float32"] <= 1e-6, rank


@pytest.mark.timeout(300)
def test_sharded_slot_order_is_identity_only_for_cyclic_ranks(
    results: list[dict[str, Any]],
) -> None:
    assert results[0]["order/interleaved"] == [0, 1, 2, 3]
    assert results[0]["order/in-a-row"] == [0, 2, 1, 3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", SHARDED_LAYOUTS)
@pytest.mark.parametrize("size", SHARD_SIZES)
def test_hierarchical_gather_and_reduce_scatter_equal_the_flat_ones(
    results: list[dict[str, Any]], layout: str, size: int
) -> None:
    for rank, result in enumerate(results):
        assert result[f"gather/{layout}/{size}/integer"] is True, rank
        assert result[f"gather/{layout}/{size}/float32"] is True, rank
        assert result[f"scatter/{layout}/{size}/integer"] is True, rank
        assert result[f"scatter/{layout}/{size}/float32"] <= 1e-6, rank
