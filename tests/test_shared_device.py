"""Two ranks on the device of the backend the device tests ask for, against torch DDP:
DP and ZeRO-3 train the same parameters, and the reducer's communication stream is
ordered after the compute that wrote the gradients.

The ranks start on ``device_backend`` (``$LAMINA_TEST_BACKEND``, cpu when unset; see
``requested_backend.py``) by name, and every rank checks that its runtime's device and
the tensors it trained are of that backend's device type. On a host with one GPU,
``benchmarks/gpu_suite.py`` sets ``LAMINA_TEST_BACKEND=cuda`` and ``LAMINA_SHARE_DEVICE=1``,
which puts both ranks on that GPU with gloo collectives, so the multi-rank CUDA paths
(streams, events, the reducer's overlap, ZeRO-3's prefetch) run where NCCL would refuse
two ranks on one device."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.testing import run_ranks
from models_for_tests import batch, build, loss_of
from requested_backend import assert_ran_on, device_use

# not ``portable``: on a CPU-only torch build it repeats what tests(cpu) runs; on a GPU
# host benchmarks/gpu_suite.py runs it with LAMINA_TEST_BACKEND=cuda, LAMINA_SHARE_DEVICE=1
pytestmark = pytest.mark.multiprocess

STEPS = 4


def _beside_ddp(strategy: str, runtime: lamina.Runtime) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``strategy`` and of DDP from one initialization; where the
    parameters and inputs of both were (``use``)."""
    device, rank = runtime.device, runtime.rank
    initial = build("mlp", seed=rank).to(device)
    options: dict[str, Any] = {"min_unit_numel": 0} if strategy == "zero3" else {}
    ours = lamina.distribute(copy.deepcopy(initial), strategy, **options)
    ddp = DDP(copy.deepcopy(initial), device_ids=None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ddp)]
    inputs: list[torch.Tensor] = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch("mlp", step, rank))
        inputs += (x, y)
        for model, opt in zip((ours, ddp), opts, strict=True):
            loss_of("mlp", model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    theirs = ddp.module.state_dict()
    if strategy == "zero3":
        # gathered by lamina's own collectives: DTensor.full_tensor() goes through torch's
        # functional all-gather, which gloo runs on device memory as if it were the host's
        # (a segfault on cuda; torch PR 132709)
        with ours.full_parameters():  # type: ignore[operator]
            state = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    else:
        state = ours.module.state_dict()  # type: ignore[union-attr]
    diffs = [float((value - theirs[name]).abs().max()) for name, value in state.items()]
    trained = [*ours.parameters(), *ddp.parameters(), *inputs]
    return {
        "diff": max(diffs),
        "device": str(device),
        "use": device_use(runtime, trained),
        "summary": ours.step_summary(),
    }


def _job(backend: str) -> dict[str, Any]:
    runtime = lamina.init(backend=backend)  # by name: LAMINA_BACKEND stays cpu in tests
    out = {s: _beside_ddp(s, runtime) for s in ("dp", "zero3")}
    out["backend"] = runtime.backend.name
    return out


@pytest.fixture(scope="module")
def results(device_backend: str) -> list[dict[str, Any]]:
    return run_ranks(_job, 2, args=(device_backend,), timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_two_ranks_on_the_device_train_like_ddp(
    results: list[dict[str, Any]], strategy: str, device_backend: str
) -> None:
    for rank, result in enumerate(results):
        assert result[strategy]["diff"] <= 1e-5, (rank, result[strategy])
        assert result[strategy]["device"] == results[0][strategy]["device"]
        # on the requested backend's device type, not on cpu by a pinned LAMINA_BACKEND
        assert_ran_on(result[strategy]["use"], device_backend)
