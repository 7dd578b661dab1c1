"""The backend that device tests run on, and the check that they really ran there.

Core tests run on cpu (``conftest.py`` pins ``LAMINA_BACKEND=cpu``). A test meant to
run on the device asks for the ``device_backend`` fixture instead: the backend named by
``$LAMINA_TEST_BACKEND`` (``benchmarks/gpu_suite.py`` sets ``cuda``), cpu when unset.
It starts its ranks on that backend by name and checks, with :func:`assert_ran_on`, that
the runtime's device and the tensors it trained are of that backend's device type: a
run that quietly fell back to cpu while cuda was asked for fails, naming both.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

#: Names the backend of the tests that are meant to run on the device (default cpu).
TEST_BACKEND_ENV = "LAMINA_TEST_BACKEND"


def requested_backend() -> str:
    """The backend ``$LAMINA_TEST_BACKEND`` names; ``cpu`` when it is unset or empty."""
    return os.environ.get(TEST_BACKEND_ENV, "").strip() or "cpu"


def usable_requested_backend() -> str:
    """:func:`requested_backend`, which must be installed and able to run here: one asked
    for by name must not pass on cpu instead, so it fails the test, saying why."""
    from lamina.errors import BackendNotFoundError
    from lamina.plugins import get_registry

    name = requested_backend()
    registry = get_registry()
    try:
        backend = registry.backend(name)
    except BackendNotFoundError as exc:
        pytest.fail(f"{TEST_BACKEND_ENV}={name}: {exc}", pytrace=False)
    availability = registry.backends[backend.name].availability
    if not availability.available:
        pytest.fail(
            f"{TEST_BACKEND_ENV}={name}: the backend cannot run here ({availability.reason}); "
            f"unset {TEST_BACKEND_ENV} to run these tests on cpu",
            pytrace=False,
        )
    return backend.name


@dataclass(frozen=True)
class DeviceUse:
    """Where a rank ran: its runtime's backend, that backend's declared device type, the
    runtime's device, and the device types of the tensors the test computed with."""

    backend: str
    declared_type: str
    device: str
    tensor_types: tuple[str, ...]


def device_use(runtime: Any, tensors: Iterable[torch.Tensor]) -> DeviceUse:
    """What ``runtime`` (a :class:`lamina.session.Runtime`) and ``tensors`` ran on."""
    return DeviceUse(
        runtime.backend.name,
        runtime.backend.device_type,
        str(runtime.device),
        tuple(sorted({t.device.type for t in tensors})),
    )


def mismatch(use: DeviceUse, requested: str) -> str | None:
    """Why ``use`` is not a run on backend ``requested``'s device; None when it is."""
    if use.backend != requested:
        return f"ran on backend {use.backend!r}, but {TEST_BACKEND_ENV} asked for {requested!r}"
    device_type = torch.device(use.device).type
    if device_type != use.declared_type:
        return (
            f"backend {requested!r} declares device type {use.declared_type!r}, but the "
            f"runtime's device is {use.device!r}"
        )
    if not use.tensor_types:
        return "no tensor was recorded, so nothing shows where the test computed"
    if use.tensor_types != (use.declared_type,):
        return (
            f"backend {requested!r} declares device type {use.declared_type!r}, but the "
            f"test's tensors were on {', '.join(use.tensor_types)}"
        )
    return None


def assert_ran_on(use: DeviceUse, requested: str) -> None:
    """AssertionError naming the mismatch unless ``use`` ran on ``requested``'s device."""
    problem = mismatch(use, requested)
    assert problem is None, problem
