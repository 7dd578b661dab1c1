"""Graph fingerprints: equal across processes and hash seeds, different for any change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lamina.graph import CapturedGraph, canonical_description, capture, fingerprint_of
from lamina.testing.harness import run_ranks

pytestmark = pytest.mark.portable

METHODS = ("export", "fx", "hooks")


class TinyLM(nn.Module):
    """Embedding, one block with a residual, tied head: small but with every feature."""

    def __init__(self, width: int, vocab: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head(h + self.mlp(self.norm(h)))


def _graphs(width: int = 32, dtype: str = "float32", seed: int = 0) -> dict[str, CapturedGraph]:
    torch.manual_seed(seed)
    model = TinyLM(width).to(getattr(torch, dtype))
    tokens = torch.randint(0, 16, (2, 6))
    return {m: capture(model, (tokens,), methods=(m,)) for m in METHODS}


def fingerprints(width: int = 32, dtype: str = "float32") -> dict[str, str]:
    """Each path's fingerprint of TinyLM (module level: ranks and subprocesses call it)."""
    return {m: g.fingerprint for m, g in _graphs(width, dtype).items()}


@pytest.fixture(scope="module")
def base() -> dict[str, CapturedGraph]:
    return _graphs()


def test_fingerprint_is_the_hash_of_the_canonical_description(
    base: dict[str, CapturedGraph],
) -> None:
    for graph in base.values():
        assert len(graph.fingerprint) == 64 and graph.fingerprint == fingerprint_of(graph)
        text = canonical_description(graph)
        assert "0x" not in text  # no memory address leaked into the description
        assert json.loads(text)["method"] == graph.method
    assert len({g.fingerprint for g in base.values()}) == len(METHODS)


@pytest.mark.multiprocess
def test_fingerprint_is_equal_across_two_processes(base: dict[str, CapturedGraph]) -> None:
    here = {m: g.fingerprint for m, g in base.items()}
    assert run_ranks(fingerprints, 2, timeout=180) == [here, here]


def test_fingerprint_is_equal_under_another_hash_seed(base: dict[str, CapturedGraph]) -> None:
    tests_dir = str(Path(__file__).resolve().parent)
    script = (
        f"import json, sys; sys.path.insert(0, {tests_dir!r}); "
        "from test_graph_fingerprint import fingerprints; print(json.dumps(fingerprints()))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        m: g.fingerprint for m, g in base.items()
    }


def test_fingerprint_ignores_parameter_values(base: dict[str, CapturedGraph]) -> None:
    other = _graphs(seed=1)
    assert {m: g.fingerprint for m, g in other.items()} == {
        m: g.fingerprint for m, g in base.items()
    }


@pytest.mark.parametrize(("width", "dtype"), [(48, "float32"), (32, "float64")])
def test_fingerprint_changes_with_width_or_dtype(
    base: dict[str, CapturedGraph], width: int, dtype: str
) -> None:
    changed = _graphs(width, dtype)
    for method in METHODS:
        assert changed[method].fingerprint != base[method].fingerprint, method
        assert changed[method].method == method
