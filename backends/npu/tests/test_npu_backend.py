"""NpuBackend's contract facts and its answers on a machine without NPUs."""

from __future__ import annotations

import importlib.metadata as md

import pytest

backend_module = pytest.importorskip(
    "lamina_npu.backend", reason="lamina-backend-npu is not installed"
)
from lamina_npu.cann import probe_cann, torch_npu_installed  # noqa: E402


def test_identity() -> None:
    backend = backend_module.NpuBackend()
    assert (backend.name, backend.priority) == ("npu", 80)
    assert (backend.device_type, backend.collective_backend) == ("npu", "hccl")


def test_unavailable_reason_names_the_fix() -> None:
    availability = backend_module.NpuBackend().availability()
    if availability.available:
        pytest.skip(f"an NPU is available here: {availability.reason}")
    reason = availability.reason
    assert reason and "\n" not in reason
    if not torch_npu_installed():
        torch_version = md.version("torch").split("+", 1)[0]
        assert f"pip install torch_npu=={torch_version}" in reason
    elif not probe_cann().usable:
        assert "libhccl.so" in reason or "libascendcl.so" in reason
        assert "set_env.sh" in reason


def test_vendor_versions_without_importing_torch_npu() -> None:
    import sys

    versions = backend_module.NpuBackend().vendor_versions()
    if torch_npu_installed():
        assert versions["torch_npu"] == md.version("torch_npu")
    else:
        assert versions == {}
    if "torch_npu" not in sys.modules:
        assert "cann" not in versions


def test_plugin_registers_the_backend() -> None:
    from lamina_npu import plugin

    (backend,) = plugin.lamina_register_backends()
    assert isinstance(backend, backend_module.NpuBackend)
