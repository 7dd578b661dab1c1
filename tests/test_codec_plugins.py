"""Codecs are found like strategies: the built-ins plus those a plugin registers through
``lamina_register_codecs``, each installed here as a distribution with a real entry point.

A plugin's codec is used by name (``distribute(model, "dp", codec=NAME)``): the plan's
buckets name it and carry its wire dtype, and training on 2 gloo ranks stays within the
codec's rounding of DDP. A plugin reusing a built-in name, or answering something that is
not a codec, is recorded as failed and the others stay.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from fake_distributions import install_fake_distribution
from lamina.errors import ConfigError
from lamina.plugins import get_registry
from lamina.strategies.codec_registry import codecs, resolve_codec
from lamina.testing import run_ranks
from lamina.testing.cli import run_lamina

pytestmark = pytest.mark.multiprocess

HALF_PLUGIN = """
import torch

from lamina.comm.codecs import Codec
from lamina.hookspecs import hookimpl


class HalfCodec(Codec):
    \"\"\"fp16 on the wire, written against the Codec contract only.\"\"\"

    name = "half-plugin"
    wire_dtype = torch.float16
    tolerance = 2.0**-10

    def encode(self, bucket):
        return bucket.to(torch.float16)

    def decode(self, wire, out):
        out.copy_(wire)


@hookimpl
def lamina_register_codecs():
    return [HalfCodec()]
"""

CLASHING_PLUGIN = """
from lamina.comm.codecs import CastCodec
import torch
from lamina.hookspecs import hookimpl


@hookimpl
def lamina_register_codecs():
    return [CastCodec("fp8", torch.bfloat16, 2.0**-8)]  # 'fp8' is built in
"""

NOT_A_CODEC_PLUGIN = """
from lamina.hookspecs import hookimpl


@hookimpl
def lamina_register_codecs():
    return ["zip"]
"""


def _install(site: Path) -> None:
    install_fake_distribution(site, "lamina-half", "lamina_half", HALF_PLUGIN)
    install_fake_distribution(site, "lamina-codec-clash", "lamina_codec_clash", CLASHING_PLUGIN)
    install_fake_distribution(site, "lamina-not-a-codec", "lamina_not_a_codec", NOT_A_CODEC_PLUGIN)


@pytest.fixture
def codec_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    get_registry(reload=True)  # lamina_clean reloads it again afterwards
    return tmp_path


def test_plugin_codecs_are_found_and_bad_ones_fail_their_plugin(codec_site: Path) -> None:
    registry = get_registry()
    known = codecs(registry)
    assert list(known)[:3] == ["bf16", "fp16", "fp8"] and "half-plugin" in known
    assert type(known["fp8"]).__module__ == "lamina.comm.codecs"  # the built-in stays
    assert resolve_codec("half-plugin", registry) is known["half-plugin"]
    clash = registry.records["lamina-codec-clash"]
    assert clash.status == "failed" and clash.stage == "hook lamina_register_codecs"
    assert "codec name 'fp8' is already registered" in (clash.error or "")
    bad = registry.records["lamina-not-a-codec"]
    assert bad.status == "failed" and "returned str, not a lamina Codec" in (bad.error or "")
    assert registry.records["lamina-half"].status == "loaded"
    with pytest.raises(ConfigError, match="codec 'zip' is unknown; use one of bf16, fp16, fp8, "):
        resolve_codec("zip", registry)


def test_lamina_info_lists_the_plugin_codec(codec_site: Path) -> None:
    result = run_lamina("info", "--json", env={"PYTHONPATH": str(codec_site)})
    assert result.returncode == 0, result.stderr
    listed = {c["name"]: c["wire_dtype"] for c in json.loads(result.stdout)["codecs"]}
    builtin = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
    assert {name: listed[name] for name in builtin} == builtin  # other plugins may add more
    assert listed["half-plugin"] == "float16"


def _train_with_plugin_codec(site: str) -> dict[str, Any]:
    sys.path.insert(0, site)
    importlib.invalidate_caches()
    get_registry(reload=True)
    runtime = lamina.init()
    torch.manual_seed(runtime.rank)  # rank-seeded: the broadcast must make them equal
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = DDP(copy.deepcopy(model))  # rank 0's weights, as distribute broadcasts them
    ours = lamina.distribute(model, "dp", codec="half-plugin")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, reference)]
    worst = 0.0
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * step + runtime.rank)
        x = torch.randn(8, 16, generator=generator)
        for module in (ours, reference):
            module(x).square().mean().backward()
        for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            worst = max(worst, float((a.grad - b.grad).norm() / b.grad.norm()))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    plan = ours.execution_plan
    buckets = [n for n in plan.collectives() if n.id.startswith("bucket")]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [p.detach().clone() for p in ours.parameters()])
    return {
        "codecs": {n.codec.name if n.codec else "none" for n in buckets},
        "wire": {n.collective.wire_dtype for n in buckets if n.collective},
        "worst_relative_grad_error": worst,
        "params_equal_on_ranks": all(
            torch.equal(a, b) for a, b in zip(gathered[0], gathered[1], strict=True)
        ),
        "events": len(ours.run_log.events),
    }


def test_a_plugin_codec_compresses_dp_buckets_and_trains_like_ddp(tmp_path: Path) -> None:
    _install(tmp_path)
    for result in run_ranks(_train_with_plugin_codec, 2, args=(str(tmp_path),), timeout=180):
        assert result["codecs"] == {"half-plugin"} and result["wire"] == {"float16"}
        assert result["params_equal_on_ranks"] and result["events"] == 0
        # fp16 carries 11 significant bits: the mean gradient is DDP's within its rounding
        assert result["worst_relative_grad_error"] <= 2e-3, result
