"""Hook calls follow pluggy: subset arguments, tryfirst/trylast order, firstresult, and a
raising implementation fails only its own plugin."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Generator
from pathlib import Path

import pytest

from fake_distributions import install_fake_distribution
from lamina.backends.cpu import CpuBackend
from lamina.device.backend import Backend
from lamina.device.kernels import KernelRegistry
from lamina.device.sysfs import discover_cpu_host
from lamina.device.topology import HostTopology
from lamina.hookspecs import hookimpl
from lamina.plugins import load_plugins
from lamina.testing.cli import run_lamina

pytestmark = pytest.mark.portable


def _described_by(who: str, local_rank: int = 0) -> HostTopology:
    host = discover_cpu_host(local_rank)
    return dataclasses.replace(host, notes=(*host.notes, f"described by {who}"))


def _describer(who: str, *, tryfirst: bool = False, trylast: bool = False) -> object:
    """A plugin whose ``lamina_discover_topology`` declares only ``local_rank``."""

    class Describer:
        @hookimpl(tryfirst=tryfirst, trylast=trylast)
        def lamina_discover_topology(self, local_rank: int) -> HostTopology:
            return _described_by(who, local_rank)

    return Describer()


def _winner(topology: HostTopology) -> str:
    return next(n for n in topology.notes if n.startswith("described by "))


def test_an_implementation_gets_only_the_arguments_it_declares() -> None:
    seen: list[object] = []

    class Partial:
        @hookimpl
        def lamina_register_backends(self) -> list[Backend]:
            return []

        @hookimpl
        def lamina_register_kernels(self) -> None:  # declares none of the spec's arguments
            seen.append("kernels")

        @hookimpl
        def lamina_discover_topology(self, local_world_size: int) -> HostTopology:
            seen.append(local_world_size)
            return _described_by("partial")

    registry = load_plugins(extra=[("partial", Partial())])
    assert registry.records["partial"].status == "loaded", registry.records["partial"].error
    topology = registry.discover_host(CpuBackend(), local_rank=0, local_world_size=3)
    assert _winner(topology) == "described by partial"
    assert seen == ["kernels", 3]


def test_call_order_is_pluggys() -> None:
    calls: list[str] = []

    def kernels_plugin(name: str, **opts: bool) -> object:
        class Plugin:
            @hookimpl(**opts)
            def lamina_register_kernels(self, registry: KernelRegistry) -> None:
                calls.append(name)

        return Plugin()

    load_plugins(
        extra=[
            ("first", kernels_plugin("first", tryfirst=True)),
            ("early", kernels_plugin("early")),
            ("last", kernels_plugin("last", trylast=True)),
            ("late", kernels_plugin("late")),
        ]
    )
    # tryfirst, then the plain ones with the last registered first, then trylast
    assert calls == ["first", "late", "early", "last"]


def test_tryfirst_wins_over_a_later_registered_implementation() -> None:
    plain = load_plugins(extra=[("early", _describer("early")), ("late", _describer("late"))])
    assert _winner(plain.discover_host(CpuBackend(), 0, 1)) == "described by late"
    first = load_plugins(
        extra=[("early", _describer("early", tryfirst=True)), ("late", _describer("late"))]
    )
    assert _winner(first.discover_host(CpuBackend(), 0, 1)) == "described by early"


def test_trylast_loses_to_an_earlier_registered_implementation() -> None:
    registry = load_plugins(
        extra=[("early", _describer("early")), ("late", _describer("late", trylast=True))]
    )
    assert _winner(registry.discover_host(CpuBackend(), 0, 1)) == "described by early"
    answers = registry.call_isolated(
        "lamina_discover_topology", backend=CpuBackend(), local_rank=0, local_world_size=1
    )
    assert [name for name, _ in answers] == ["early"]  # firstresult: one answer, then stop


def test_a_raising_firstresult_implementation_fails_only_its_plugin() -> None:
    class Boom:
        @hookimpl
        def lamina_register_backends(self) -> list[Backend]:
            class BoomBackend(CpuBackend):
                name = "boom"

            return [BoomBackend()]

        @hookimpl(tryfirst=True)
        def lamina_discover_topology(self, backend: Backend) -> HostTopology:
            raise RuntimeError("site database unreachable")

    registry = load_plugins(extra=[("site", _describer("site")), ("boom", Boom())])
    assert "boom" in registry.backends
    topology = registry.discover_host(CpuBackend(), 0, 1)
    assert _winner(topology) == "described by site"
    record = registry.records["boom"]
    assert (record.status, record.stage) == ("failed", "hook lamina_discover_topology")
    assert record.error == "RuntimeError: site database unreachable"
    assert "boom" not in registry.backends  # unregistered with what it provided
    assert registry.manager.get_plugin("boom") is None


def test_a_wrong_answer_fails_its_plugin_and_the_next_one_answers() -> None:
    class Wrong:
        @hookimpl(tryfirst=True)
        def lamina_discover_topology(self) -> str:
            return "node17"

    registry = load_plugins(extra=[("site", _describer("site")), ("wrong", Wrong())])
    assert _winner(registry.discover_host(CpuBackend(), 0, 1)) == "described by site"
    assert registry.records["wrong"].stage == "hook lamina_discover_topology"
    assert "returned str" in (registry.records["wrong"].error or "")
    assert registry.records["site"].status == "loaded"


def test_no_answer_falls_back_to_the_backend() -> None:
    class Silent:
        @hookimpl
        def lamina_discover_topology(self) -> None:
            return None

    registry = load_plugins(extra=[("silent", Silent())])
    topology = registry.discover_host(CpuBackend(), 0, 1)
    assert topology == CpuBackend().discover_host_topology(0, 1)
    assert registry.records["silent"].status == "loaded"


def test_tryfirst_does_not_take_a_backend_name_from_an_earlier_plugin() -> None:
    class Clash:
        @hookimpl(tryfirst=True)
        def lamina_register_backends(self) -> list[Backend]:
            return [CpuBackend()]

    registry = load_plugins(extra=[("clash", Clash())])
    assert registry.backends["cpu"].plugin == "cpu"
    assert registry.records["clash"].status == "failed"
    assert "already provided by 'cpu'" in (registry.records["clash"].error or "")


def test_hook_wrappers_are_rejected_at_validation() -> None:
    class Wrapper:
        @hookimpl(wrapper=True)
        def lamina_register_kernels(
            self, registry: KernelRegistry
        ) -> Generator[None, object, object]:
            return (yield)

    registry = load_plugins(extra=[("wrapper", Wrapper())])
    record = registry.records["wrapper"]
    assert (record.status, record.stage) == ("failed", "validation")
    assert "hook wrapper" in (record.error or "") and "\n" not in (record.error or "")


def test_info_reports_a_raising_topology_plugin_and_uses_the_next(tmp_path: Path) -> None:
    install_fake_distribution(
        tmp_path,
        "lamina-topo-broken",
        "lamina_topo_broken",
        """
        from lamina.hookspecs import hookimpl

        @hookimpl(tryfirst=True)
        def lamina_discover_topology(backend):
            raise ConnectionError("site inventory at inventory.example unreachable")
        """,
    )
    install_fake_distribution(
        tmp_path,
        "lamina-topo-site",
        "lamina_topo_site",
        """
        import dataclasses

        from lamina.device.sysfs import discover_cpu_host
        from lamina.hookspecs import hookimpl

        @hookimpl
        def lamina_discover_topology(local_rank):
            host = discover_cpu_host(local_rank)
            note = f"site inventory: rack 7, local rank {local_rank}"
            return dataclasses.replace(host, notes=(*host.notes, note))
        """,
    )
    result = run_lamina("info", "--json", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    plugins = {p["name"]: p for p in report["plugins"]}
    broken = plugins["lamina-topo-broken"]
    assert (broken["status"], broken["stage"]) == ("failed", "hook lamina_discover_topology")
    assert "inventory.example unreachable" in broken["error"]
    assert plugins["lamina-topo-site"]["status"] == "loaded"
    assert "site inventory: rack 7, local rank 0" in report["topology"]["notes"]
    assert report["selected_backend"] == "cpu"
