"""One training step on the XLA device, chosen through lamina, against a CPU reference.

Runs with ``PJRT_DEVICE=CPU`` (XLA compiles the step for the host CPU); skips with the
backend's own reason where torch_xla is missing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lamina
from lamina.device.backend import Backend
from lamina.device.handle import DeviceHandle
from lamina.plugins import BACKEND_ENV, get_registry


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, sync: DeviceHandle | None = None
) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if sync is not None:
        sync.synchronize()
    return loss.detach()


def _assert_matches_cpu(model: nn.Module, loss: torch.Tensor, device: torch.device) -> None:
    reference = _model()
    x, y = _batch()
    want_loss = _step(reference, x, y)
    assert loss.device.type == "xla" and loss.device == device
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=1e-5, atol=1e-6)
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert got.device == device, name
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-6)


class TestXlaTrainingStep:
    backends = ("xla",)

    def test_step_selected_by_env(
        self, lamina_backend: Backend, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(BACKEND_ENV, "xla")
        backend = get_registry().select_backend()
        assert backend is lamina_backend
        handle = backend.handle()
        device = handle.device_for_local_rank(0)
        handle.set_device(device)
        model = _model().to(device)
        x, y = _batch()
        loss = _step(model, x.to(device), y.to(device), handle)
        _assert_matches_cpu(model, loss, device)

    def test_step_through_init(self, lamina_backend: Backend) -> None:
        with lamina.init(backend="xla") as runtime:
            assert runtime.backend is lamina_backend and runtime.device.type == "xla"
            model = _model().to(runtime.device)
            x, y = _batch()
            loss = _step(model, x.to(runtime.device), y.to(runtime.device), runtime.handle)
            _assert_matches_cpu(model, loss, runtime.device)
