"""Plugin discovery: isolation of broken plugins, backend choice and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_distributions import install_fake_distribution
from lamina.backends.cpu import CpuBackend
from lamina.device.backend import Availability, Backend
from lamina.errors import BackendNotFoundError, BackendUnavailableError
from lamina.hookspecs import hookimpl
from lamina.plugins import load_plugins
from lamina.testing.cli import run_lamina

pytestmark = pytest.mark.portable


@pytest.fixture
def broken_site(tmp_path: Path) -> Path:
    install_fake_distribution(
        tmp_path,
        "lamina-broken-import",
        "lamina_broken_import",
        'raise RuntimeError("vendor runtime exploded on import")\n',
    )
    install_fake_distribution(
        tmp_path,
        "lamina-broken-hook",
        "lamina_broken_hook",
        """
        from lamina.hookspecs import hookimpl

        @hookimpl
        def lamina_register_backends():
            raise OSError("libvendor.so: cannot open shared object file")
        """,
    )
    install_fake_distribution(
        tmp_path,
        "lamina-bad-hookname",
        "lamina_bad_hookname",
        """
        from lamina.hookspecs import hookimpl

        @hookimpl
        def lamina_register_backend():  # misspelt: no such hook
            return []
        """,
    )
    return tmp_path


def test_broken_plugins_are_listed_and_cpu_still_works(broken_site: Path) -> None:
    result = run_lamina("info", "--json", env={"PYTHONPATH": str(broken_site)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["lamina-broken-import"]["status"] == "failed"
    assert plugins["lamina-broken-import"]["stage"] == "import"
    assert "vendor runtime exploded on import" in plugins["lamina-broken-import"]["error"]
    assert plugins["lamina-broken-hook"]["stage"] == "hook lamina_register_backends"
    assert "libvendor.so" in plugins["lamina-broken-hook"]["error"]
    assert plugins["lamina-bad-hookname"]["stage"] == "validation"
    assert "lamina_register_backend" in plugins["lamina-bad-hookname"]["error"]
    assert plugins["cpu"]["status"] == "loaded"
    assert report["selected_backend"] == "cpu"
    assert {b["name"]: b["available"] for b in report["backends"]}["cpu"] is True


def test_info_table_shows_failed_plugin(broken_site: Path) -> None:
    result = run_lamina("info", env={"PYTHONPATH": str(broken_site), "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert "failed" in result.stdout and "vendor runtime exploded" in result.stdout
    assert "selected backend: cpu" in result.stdout
    assert "cpu: available — " in result.stdout


class TwinCpuBackend(CpuBackend):
    """A second, real CPU backend under another name and a higher priority."""

    name = "cpu-twin"
    priority = 1000


class MissingDeviceBackend(CpuBackend):
    name = "nodevice"
    priority = 2000

    def availability(self) -> Availability:
        return Availability.no("no nodevice driver found; install the nodevice runtime")


class ExtraBackends:
    @hookimpl
    def lamina_register_backends(self) -> list[Backend]:
        return [TwinCpuBackend(), MissingDeviceBackend()]


def test_highest_priority_available_backend_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAMINA_BACKEND")
    registry = load_plugins(extra=[("extra", ExtraBackends())])
    assert registry.select_backend().name == "cpu-twin"


def test_lamina_backend_env_overrides_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = load_plugins(extra=[("extra", ExtraBackends())])
    monkeypatch.setenv("LAMINA_BACKEND", "cpu")
    assert registry.select_backend().name == "cpu"


def test_unknown_backend_name_lists_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = load_plugins(extra=[("extra", ExtraBackends())])
    monkeypatch.setenv("LAMINA_BACKEND", "tpu9000")
    with pytest.raises(BackendNotFoundError) as info:
        registry.select_backend()
    message = str(info.value)
    assert "'tpu9000'" in message
    installed = message.split("installed backends: ")[1].split(" (")[0].split(", ")
    assert {"cpu", "cpu-twin", "nodevice"} <= set(installed) and installed == sorted(installed)
    assert "\n" not in message


def test_unavailable_backend_by_name_gives_its_reason() -> None:
    registry = load_plugins(extra=[("extra", ExtraBackends())])
    with pytest.raises(BackendUnavailableError, match="install the nodevice runtime"):
        registry.select_backend("nodevice")


class SlowProbeBackend(CpuBackend):
    """Stands for a vendor backend whose probe imports a runtime that takes seconds."""

    name = "slowprobe"
    priority = -1
    probes = 0

    def availability(self) -> Availability:
        SlowProbeBackend.probes += 1
        return Availability.no("probed")


class SlowProbe:
    @hookimpl
    def lamina_register_backends(self) -> list[Backend]:
        return [SlowProbeBackend()]


def test_availability_is_probed_only_for_the_backends_asked_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    SlowProbeBackend.probes = 0
    registry = load_plugins(extra=[("slow", SlowProbe())])
    assert registry.select_backend("cpu").name == "cpu"
    assert SlowProbeBackend.probes == 0  # chosen by name: the others are never probed
    monkeypatch.delenv("LAMINA_BACKEND")
    best = registry.select_backend().name  # by priority: every backend is probed
    assert best != "slowprobe" and registry.select_backend().name == best
    assert registry.backends["slowprobe"].availability.reason == "probed"
    assert SlowProbeBackend.probes == 1  # once, then kept


def test_cli_reports_unknown_backend_in_one_line() -> None:
    result = run_lamina("info", env={"LAMINA_BACKEND": "nope", "COLUMNS": "200"})
    assert result.returncode == 1
    output = " ".join(result.stdout.split())
    assert "unknown backend 'nope'; installed backends:" in output and "cpu" in output


def test_duplicate_backend_name_is_a_recorded_conflict() -> None:
    class Clash:
        @hookimpl
        def lamina_register_backends(self) -> list[Backend]:
            return [CpuBackend()]

    registry = load_plugins(extra=[("clash", Clash())])
    assert registry.backends["cpu"].plugin == "cpu"
    assert registry.records["clash"].status == "failed"
    assert "already provided" in (registry.records["clash"].error or "")


def test_plugin_returning_wrong_type_is_failed() -> None:
    class Wrong:
        @hookimpl
        def lamina_register_backends(self) -> list[object]:
            return ["cuda"]

    registry = load_plugins(extra=[("wrong", Wrong())])
    assert registry.records["wrong"].status == "failed"
    assert "Backend instances" in (registry.records["wrong"].error or "")
    assert registry.select_backend().name == "cpu"


def test_kernel_hook_failure_keeps_builtin_kernels() -> None:
    class BadKernels:
        @hookimpl
        def lamina_register_kernels(self, registry: object) -> None:
            raise RuntimeError("triton missing")

    registry = load_plugins(extra=[("badk", BadKernels())])
    assert registry.records["badk"].stage == "hook lamina_register_kernels"
    assert {"pack_bucket", "unpack_bucket", "scale_accumulate"} <= set(registry.kernels.names())
    assert "cpu" in registry.kernels.backends_for("pack_bucket")
