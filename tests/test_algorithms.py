"""Every all-reduce algorithm equals the flat all-reduce: exactly on integers, within
1e-6 on floats; on 4 gloo ranks laid out as 2 hosts x 2, interleaved."""

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
from lamina.testing import run_ranks
from topologies_for_tests import two_hosts_interleaved

WORLD = 4
#: (algorithm, chunks); sizes include ones that need padding to equal shards.
CASES = (("ordered", 1), ("hierarchical", 1), ("pipelined", 2), ("pipelined", 4))
SIZES = (1, 7, 1000, 4099)


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
