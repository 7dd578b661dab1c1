"""Compile once per job (``lamina.strategies.compiled.compile_cache``): on 2 gloo ranks
whose graphs are the same (``dp``), rank 0 compiles the step with Inductor and rank 1
loads its artifacts instead of compiling; a second job with the same cache directory
(and a fresh Inductor cache) loads the cache file; a corrupt cache file is named in a
warning and the step compiles and trains as usual; ``LAMINA_COMPILE_ONCE=0`` compiles on
every rank. Losses equal the eager step's.

Inductor compiles a tiny model here (a few seconds of C++ per rank); every test gets its
own Inductor cache directory so that what the caches hold is the test's doing.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lamina
from lamina.strategies.compiled import compile_cache
from lamina.strategies.compiled.compile_cache import Outcome, graph_key
from lamina.testing import run_ranks

STEPS = 3
#: Inductor's kernels against eager's ops, fp32, a tiny model.
TOLERANCE = 1e-5


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train() -> dict[str, Any]:
    """3 steps of a compiled dp step (Inductor) and of the eager step, from rank-seeded
    weights (the broadcasts make them equal): losses, how the graph was compiled."""
    warnings = _Collect()
    logging.getLogger("lamina.compile").addHandler(warnings)
    runtime = lamina.init()
    torch.manual_seed(runtime.rank)
    initial = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    eager = lamina.distribute(copy.deepcopy(initial), "dp")
    compiled = lamina.distribute(copy.deepcopy(initial), "dp")
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    step = lamina.compile_step(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), F.mse_loss)
    worst = 0.0
    for k in range(STEPS):
        generator = torch.Generator().manual_seed(10 * k + runtime.rank)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)
        loss = step(x, y)
        opt_eager.zero_grad(set_to_none=True)
        reference = F.mse_loss(eager(x), y)
        reference.backward()
        opt_eager.step()
        worst = max(worst, abs(float(loss) - float(reference)))
    params = max(
        (a - b).abs().max().item()
        for a, b in zip(compiled.parameters(), eager.parameters(), strict=True)
    )
    (outcome,) = step.checked.once.outcomes
    return {
        "loss": worst,
        "param": params,
        "eager_reason": step.eager_reason,
        "how": outcome.how,
        "inductor_compiles": outcome.inductor_compiles,
        "describe": outcome.describe(),
        "summary": compiled.step_summary(),
        "warnings": warnings.lines,
    }


def _env(tmp: Path, job: str, **more: str) -> dict[str, str]:
    """A job's environment: its own Inductor cache, the shared lamina cache directory."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{job}"),
        compile_cache.ENV_DIR: str(tmp / "lamina-cache"),
        **more,
    }


def _trains_as_eager(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["eager_reason"] == "", result
        assert result["loss"] <= TOLERANCE and result["param"] <= TOLERANCE, result


@pytest.mark.multiprocess
@pytest.mark.timeout(450)
def test_one_rank_compiles_the_other_loads_the_next_job_loads_the_file_and_a_corrupt_one(
    tmp_path: Path,
) -> None:
    """Three jobs: the first compiles on rank 0; the second, its Inductor cache empty,
    reads the file; the third finds the file corrupt, names it, compiles and rewrites it."""
    first = run_ranks(_train, 2, env=_env(tmp_path, "first"), timeout=240)
    _trains_as_eager(first)
    zero, one = first
    assert zero["how"] == "compiled" and zero["inductor_compiles"] >= 1, zero
    assert one["how"] == "loaded" and one["inductor_compiles"] == 0, one  # no compile there
    line = "(cold: compiled on rank 0, 1 rank loaded its artifacts)"
    assert "first step: " in zero["summary"] and line in zero["summary"], zero
    assert line in one["summary"], one
    files = list((tmp_path / "lamina-cache").glob("*.bin"))
    assert len(files) == 1 and files[0].stat().st_size > 0, files

    # a second job, its Inductor cache empty: the cache file is all it has; every rank
    # reads it, so none waits for another
    second = run_ranks(_train, 2, env=_env(tmp_path, "second"), timeout=240)
    _trains_as_eager(second)
    for result in second:
        assert result["how"] == "cache file" and result["inductor_compiles"] == 0, result
        line = "(warm: cache file read on ranks 0, 1)"
        assert line in result["summary"] and result["warnings"] == [], result

    # a third job finds the file corrupt: named in one warning, compiled, rewritten
    (path,) = files
    path.write_bytes(b"not torch's artifacts")
    results = run_ranks(_train, 2, env=_env(tmp_path, "corrupt"), timeout=240)
    _trains_as_eager(results)
    zero, one = results
    assert zero["how"] == "compiled" and zero["inductor_compiles"] >= 1, zero
    (warning,) = zero["warnings"]  # the rank that reads the file names it
    assert str(path) in warning and "delete it" in warning, warning
    assert one["how"] == "loaded" and one["inductor_compiles"] == 0, one
    assert path.read_bytes() != b"not torch's artifacts"  # rewritten from the compile


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compile_once_off_compiles_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(
        _train, 2, env=_env(tmp_path, "off", **{compile_cache.ENV_ONCE: "0"}), timeout=240
    )
    _trains_as_eager(results)
    for result in results:
        assert result["how"] == "compiled" and result["inductor_compiles"] >= 1, result
        assert "(cold: compiled on every rank)" in result["summary"], result
    assert not (tmp_path / "lamina-cache").exists()  # no exchange, no cache file


def test_a_graphs_leader_is_the_lowest_rank_holding_it() -> None:
    assert compile_cache._leaders(["a", "b", "a", "c", "b"]) == [0, 1, 0, 3, 1]
    # where every rank holding a graph loaded its cache file, each is its own leader
    held = [("a", True), ("b", True), ("a", True), ("b", False)]
    assert compile_cache._leaders_unless_loaded(held) == [0, 1, 2, 1]


def test_outcomes_read_as_cold_or_warm_with_the_ranks() -> None:
    shared = Outcome("compiled", ((0, "compiled"), (2, "compiled")), (1, 3), 1.0, 1)
    assert shared.describe() == "cold: compiled on ranks 0, 2, 2 ranks loaded the artifacts"
    warm = Outcome("loaded", ((0, "torch cache"),), (1,), 1.0, 0)
    assert warm.describe() == "warm: torch's cache on rank 0, 1 rank loaded its artifacts"
    assert not warm.cold and shared.cold


def test_the_graph_key_follows_the_code_the_shapes_and_the_settings() -> None:
    gm = torch.fx.symbolic_trace(nn.Linear(3, 2))
    x = torch.zeros(4, 3)
    key = graph_key(gm, [x], "inductor", {"fallback_random": True})
    assert key == graph_key(gm, [torch.ones(4, 3)], "inductor", {"fallback_random": True})
    assert key != graph_key(gm, [torch.zeros(5, 3)], "inductor", {"fallback_random": True})
    assert key != graph_key(gm, [x], "inductor", {"fallback_random": False})
    other = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 2), nn.ReLU()))
    assert key != graph_key(other, [x], "inductor", {"fallback_random": True})


def test_the_cache_directory_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compile_cache.ENV_DIR, raising=False)
    assert compile_cache.cache_dir() == Path("~/.cache/lamina/compiled").expanduser()
    monkeypatch.setenv(compile_cache.ENV_DIR, "")
    assert compile_cache.cache_dir() is None
    monkeypatch.setenv(compile_cache.ENV_DIR, "/somewhere")
    assert compile_cache.cache_dir() == Path("/somewhere")
