"""Backend "template" beyond the kit: selection by name, labelling, its kernel.

Everything is reached the way lamina reaches it, through the installed entry point.
"""

from __future__ import annotations

import pytest
import torch

from lamina.device.kernels import Dim3, KernelLauncher
from lamina.errors import KernelError
from lamina.plugins import BACKEND_ENV, load_plugins


def test_lamina_backend_env_selects_template(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "template")
    registry = load_plugins()
    record = registry.records["template"]
    assert record.status == "loaded", record.error
    backend = registry.select_backend()
    assert backend.name == "template"
    assert type(backend).__module__ == "lamina_template.backend"


def test_never_chosen_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert load_plugins().select_backend().name != "template"


def test_labelled_as_a_template() -> None:
    registry = load_plugins()
    backend = registry.backend("template")
    availability = registry.backends["template"].availability
    assert availability.available and "TEMPLATE" in availability.reason
    assert backend.priority < 0
    assert any("TEMPLATE" in note for note in backend.discover_host_topology(0, 1).notes)
    assert {"torch", "lamina-backend-template"} <= set(backend.vendor_versions())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 255, 1000, 70_001])
def test_scale_accumulate_equals_reference(dtype: torch.dtype, numel: int) -> None:
    launcher = KernelLauncher(load_plugins().kernels, "template")
    assert launcher.implementation_name("scale_accumulate") == "template"
    gen = torch.Generator().manual_seed(numel)
    dst = torch.randn(numel, generator=gen).to(dtype)
    src = torch.randn(numel, generator=gen).to(dtype)
    got = launcher.launch("scale_accumulate", dst.clone(), src, -0.3)
    want = launcher.reference("scale_accumulate", dst.clone(), src, -0.3)
    assert torch.equal(got, want)


def test_scale_accumulate_refuses_a_launch_too_small() -> None:
    launcher = KernelLauncher(load_plugins().kernels, "template")
    dst, src = torch.zeros(1000), torch.ones(1000)
    with pytest.raises(KernelError, match="cannot cover 1000 elements"):
        launcher.launch("scale_accumulate", dst, src, 1.0, grid=Dim3(1))
