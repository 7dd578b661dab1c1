"""``lamina.compile_step`` on the XLA device: the whole step as one XLA graph per step.

torch_xla's dynamo backend (``openxla``) compiles the captured step (forward, loss,
backward, the optimizer's update) into one XLA program, run on the PJRT CPU device
here; it must match the same steps taken eagerly on the CPU. Skips with the backend's
own reason where torch_xla is missing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lamina
from lamina.device.backend import Backend

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


class TestXlaCompiledStep:
    backends = ("xla",)

    def test_the_compiled_step_runs_on_the_xla_device_and_matches_eager(
        self, lamina_backend: Backend
    ) -> None:
        with lamina.init(backend="xla") as runtime:
            device = runtime.device
            model = lamina.distribute(_model().to(device), "dp")
            step = lamina.compile_step(model, _optimizer(model), F.mse_loss, backend="openxla")
            reference = _model()
            ref_opt = _optimizer(reference)
            for k in range(STEPS):
                x, y = _batch(k)
                loss = step(x.to(device), y.to(device))
                runtime.handle.synchronize()
                want = F.mse_loss(reference(x), y)
                want.backward()
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
                assert loss.device == device
                torch.testing.assert_close(loss.cpu(), want.detach(), rtol=1e-5, atol=1e-6)
            for (name, got), expected in zip(
                model.named_parameters(), reference.parameters(), strict=True
            ):
                torch.testing.assert_close(
                    got.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6, msg=name
                )
            assert step.eager_reason == "", step.eager_reason
            plan = model.execution_plan
            modes = {n.detail.mode for n in plan.nodes if hasattr(n.detail, "mode")}
            assert modes == {"compiled_step:openxla"}
            assert len(step.checked.graphs) == 1  # captured once, replayed
            assert "xla traces each step" in dict(plan.meta)["device_graphs"]
