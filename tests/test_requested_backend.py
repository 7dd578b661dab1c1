"""The device tests fail when they do not run where ``$LAMINA_TEST_BACKEND`` asks.

``mislabelled`` is a backend installed through a throwaway distribution's entry point (as
a backend package is found) that declares device type ``cuda`` but hands out the host
CPU: a run that fell back to cpu while cuda was asked for. Asked for by name, the
shared-device test's own training runs on it, and the test's check fails naming the
mismatch.
A cpu backend pinned by ``LAMINA_BACKEND`` (what once overrode the GPU suite's request)
fails the check too, and a requested backend that is not installed fails the test
instead of letting it pass on cpu.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

import pytest
import torch

import lamina
from fake_distributions import install_fake_distribution
from lamina.plugins import get_registry
from requested_backend import (
    TEST_BACKEND_ENV,
    assert_ran_on,
    device_use,
    mismatch,
    requested_backend,
    usable_requested_backend,
)
from test_shared_device import _beside_ddp as beside_ddp

MISLABELLED = """\
from lamina.backends.cpu import CpuBackend
from lamina.hookspecs import hookimpl


class MislabelledBackend(CpuBackend):
    \"\"\"Declares cuda, hands out the host CPU.\"\"\"

    name = "mislabelled"
    device_type = "cuda"
    priority = -100


@hookimpl
def lamina_register_backends():
    return [MislabelledBackend()]
"""


@pytest.fixture(scope="module")
def mislabelled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``mislabelled`` backend, installed as a lamina plugin (entry point on sys.path)."""
    site = tmp_path_factory.mktemp("mislabelled-site")
    dist = "lamina-mislabelled-backend"
    install_fake_distribution(site, dist, "mislabelled_backend", MISLABELLED)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        record = get_registry(reload=True).records[dist]
        assert record.status == "loaded", record.error
        yield "mislabelled"
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()
        get_registry(reload=True)


def test_the_shared_device_check_fails_on_cpu_when_cuda_was_asked_for(
    mislabelled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP beside DDP, the shared-device test's training on one rank in this process (its
    ZeRO-3 half builds DTensors on the declared ``cuda``, which a CPU torch refuses)."""
    monkeypatch.setenv(TEST_BACKEND_ENV, mislabelled)
    requested = usable_requested_backend()
    assert requested == "mislabelled"
    runtime = lamina.init(backend=requested)  # as the shared-device job starts its ranks
    result = beside_ddp("dp", runtime)
    assert result["diff"] <= 1e-5  # it trains: only the device is wrong
    with pytest.raises(AssertionError) as failure:
        assert_ran_on(result["use"], requested)
    assert str(failure.value).splitlines()[0] == (
        "backend 'mislabelled' declares device type 'cuda', but the runtime's device is 'cpu'"
    )


def test_a_pinned_cpu_backend_fails_the_check_when_another_was_asked_for(
    mislabelled: str,
) -> None:
    runtime = lamina.init()  # LAMINA_BACKEND=cpu, pinned by conftest.py
    use = device_use(runtime, [torch.ones(2, device=runtime.device)])
    assert mismatch(use, "cpu") is None  # the honest case passes
    with pytest.raises(AssertionError) as failure:
        assert_ran_on(use, mislabelled)
    assert str(failure.value).splitlines()[0] == (
        f"ran on backend 'cpu', but {TEST_BACKEND_ENV} asked for 'mislabelled'"
    )


def test_tensors_off_the_declared_device_fail_the_check() -> None:
    runtime = lamina.init()
    on_meta = device_use(runtime, [torch.ones(2), torch.empty(2, device="meta")])
    assert mismatch(on_meta, "cpu") == (
        "backend 'cpu' declares device type 'cpu', but the test's tensors were on cpu, meta"
    )
    assert mismatch(device_use(runtime, []), "cpu") == (
        "no tensor was recorded, so nothing shows where the test computed"
    )


def test_the_requested_backend_is_cpu_unless_named_and_must_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TEST_BACKEND_ENV, raising=False)
    assert requested_backend() == usable_requested_backend() == "cpu"
    monkeypatch.setenv(TEST_BACKEND_ENV, " ")
    assert requested_backend() == "cpu"
    monkeypatch.setenv(TEST_BACKEND_ENV, "nope")
    try:  # caught by hand: a skip raised here would skip this test instead of failing it
        usable_requested_backend()
    except BaseException as exc:
        outcome: BaseException | None = exc
    else:
        outcome = None
    assert isinstance(outcome, pytest.fail.Exception), outcome
    assert str(outcome).startswith(
        f"{TEST_BACKEND_ENV}=nope: unknown backend 'nope'; installed backends: "
    )
