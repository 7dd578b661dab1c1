"""Ranks against devices: one line (and nothing started) when a host's ranks outnumber
the devices of a backend that gives each rank its own, ``--nproc-per-node gpu``, and the
``LAMINA_SHARE_DEVICE=1`` test mode. The device count is faked at the backend boundary:
a CPU backend that declares one device per rank (``one-device``), installed as a plugin
through an entry point, as a vendor backend would be."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

import lamina
from lamina.backends.cpu import CpuBackend
from lamina.cli.run import fit_ranks_to_devices, plan_launch
from lamina.device.sharing import (
    SHARE_DEVICE_ENV,
    check_ranks_fit,
    collective_backend,
    share_device,
)
from lamina.errors import ConfigError
from lamina.testing.cli import run_lamina


class OneDeviceBackend(CpuBackend):
    """The host CPU posing as a backend with one device that each rank needs alone."""

    name = "one-device"
    priority = -100
    collective_backend = "nccl"  # never initialized: only the shared mode runs it, on gloo
    one_device_per_rank = True
    visible_devices_env = "ONE_DEVICE_VISIBLE"


class _Registry:
    def select_backend(self, name: str | None = None) -> CpuBackend:
        return OneDeviceBackend()


@pytest.mark.portable
def test_more_ranks_than_devices_is_one_line_naming_both_and_the_fixes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SHARE_DEVICE_ENV, raising=False)
    check_ranks_fit(OneDeviceBackend(), 1, 1)
    check_ranks_fit(CpuBackend(), 8, 1)  # the CPU is shared by design
    with pytest.raises(ConfigError) as info:
        check_ranks_fit(OneDeviceBackend(), 2, 1)
    message = str(info.value)
    assert "\n" not in message
    assert "2 ranks on this host but 1 one-device device(s) visible" in message
    assert "--nproc-per-node 1" in message and "--nproc-per-node gpu" in message
    assert "ONE_DEVICE_VISIBLE" in message and f"{SHARE_DEVICE_ENV}=1" in message
    assert collective_backend(OneDeviceBackend()) == "nccl"


@pytest.mark.portable
def test_the_shared_mode_is_explicit_and_runs_collectives_on_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SHARE_DEVICE_ENV, "1")
    assert share_device()
    check_ranks_fit(OneDeviceBackend(), 4, 1)
    assert collective_backend(OneDeviceBackend()) == "gloo"
    assert collective_backend(CpuBackend()) == "gloo"
    monkeypatch.setenv(SHARE_DEVICE_ENV, "yes")
    with pytest.raises(ConfigError, match=f"{SHARE_DEVICE_ENV}='yes' is not 0 or 1"):
        share_device()


@pytest.mark.portable
def test_init_refuses_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARE_DEVICE_ENV, raising=False)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("lamina.session.get_registry", _Registry)
    with pytest.raises(ConfigError, match="2 ranks on this host but 1 one-device"):
        lamina.init()
    assert not dist.is_initialized()


@pytest.mark.portable
def test_run_turns_gpu_into_the_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARE_DEVICE_ENV, raising=False)
    monkeypatch.setattr("lamina.plugins.get_registry", _Registry)
    plan = fit_ranks_to_devices(plan_launch(["--nproc-per-node", "gpu", "s.py", "-x"]), None)
    assert plan.torchrun_argv[-3:] == ["--nproc-per-node=1", "s.py", "-x"]
    with pytest.raises(ConfigError, match="2 ranks on this host but 1"):
        fit_ranks_to_devices(plan_launch(["--nproc-per-node", "2", "s.py"]), None)
    one = plan_launch(["--nproc-per-node", "1", "s.py"])
    assert fit_ranks_to_devices(one, None) == one


PLUGIN = """
from lamina.hookspecs import hookimpl
from test_device_sharing import OneDeviceBackend


@hookimpl
def lamina_register_backends():
    return [OneDeviceBackend()]
"""

SCRIPT = """
import sys
import torch
import torch.distributed as dist
import lamina

with lamina.init() as rt:
    value = torch.ones(1) * (rt.rank + 1)
    dist.all_reduce(value)
    sys.stdout.write(
        f"rank={rt.rank} world={rt.world_size} device={rt.device} "
        f"pg={dist.get_backend()} sum={value.item():g}\\n"
    )
"""


@pytest.fixture
def one_device(tmp_path: Path) -> dict[str, str]:
    """The environment in which ``one-device`` is an installed backend."""
    site = tmp_path / "site"
    info = site / "lamina_one_device-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lamina-one-device\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lamina]\none-device = one_device_plugin\n")
    (site / "one_device_plugin.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    here = str(Path(__file__).parent)
    path = os.pathsep.join([str(site), here, os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "SCRIPT": str(tmp_path / "script.py")}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_lamina_run_refuses_in_one_line_and_shares_in_the_test_mode(
    one_device: dict[str, str],
) -> None:
    env = {"PYTHONPATH": one_device["PYTHONPATH"], SHARE_DEVICE_ENV: "0"}
    script = one_device["SCRIPT"]
    refused = run_lamina("run", "--nproc-per-node", "2", "--backend", "one-device", script, env=env)
    assert refused.returncode != 0
    assert refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "2 ranks on this host but 1 one-device device(s) visible" in refused.stderr
    assert "rank=" not in refused.stdout  # nothing started
    env[SHARE_DEVICE_ENV] = "1"  # the fake's "nccl" cannot start on a CPU build: gloo
    shared = run_lamina("run", "--nproc-per-node", "2", "--backend", "one-device", script, env=env)
    assert shared.returncode == 0, shared.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank={rank} world=2 device=cpu pg=gloo sum=3" in shared.stdout, shared.stdout
