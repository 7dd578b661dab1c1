"""pytest plugin of the conformance kit: backend fixtures and ``--lamina-backend``.

Registered through the ``pytest11`` entry point, so it is active wherever lamina-core
is installed. It imports lamina only when a test asks for a lamina fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from lamina.device.backend import Backend
    from lamina.device.handle import DeviceHandle
    from lamina.testing.conformance import CollectiveRun


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--lamina-backend NAME`` (repeatable) to restrict the conformance kit."""
    group = parser.getgroup("lamina", "lamina conformance kit")
    group.addoption(
        "--lamina-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run lamina backend tests only for this installed backend (repeatable)",
    )


def _backend_names(metafunc: pytest.Metafunc) -> list[str]:
    from lamina.plugins import get_registry

    requested: list[str] = metafunc.config.getoption("lamina_backend")
    restricted = getattr(metafunc.cls, "backends", None)
    names = requested or restricted or sorted(get_registry().backends)
    if restricted and requested:
        names = [n for n in requested if n in restricted]
    return list(names)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``lamina_backend_name`` over the requested or installed backends.

    The parameter is class-scoped, so a class-scoped fixture (``lamina_collectives``) runs
    once per backend and class. A test that also takes ``lamina_kernel_name`` runs once
    per backend and kernel sample set (the class's ``kernel_samples``), with an id
    ``<backend>-<kernel>@<implementation>`` naming the implementation a launch runs.
    """
    if "lamina_backend_name" not in metafunc.fixturenames:
        return
    names = _backend_names(metafunc)
    if "lamina_kernel_name" not in metafunc.fixturenames:
        metafunc.parametrize("lamina_backend_name", names, ids=names, scope="class")
        return
    from lamina.plugins import get_registry
    from lamina.testing.conformance import KERNEL_SAMPLES

    registry = get_registry().kernels
    kernels = sorted(getattr(metafunc.cls, "kernel_samples", None) or KERNEL_SAMPLES)
    defined = set(registry.names())
    pairs = [(backend, kernel) for backend in names for kernel in kernels]
    ids = [
        f"{b}-{k}@{registry.implementation(k, b)[1] if k in defined else 'undefined'}"
        for b, k in pairs
    ]
    metafunc.parametrize(
        ("lamina_backend_name", "lamina_kernel_name"), pairs, ids=ids, scope="class"
    )


def available_backend(name: str) -> Backend:
    """The installed backend ``name``; skips the test, with the reason, when it cannot run."""
    from lamina.errors import BackendNotFoundError
    from lamina.plugins import get_registry

    registry = get_registry()
    try:
        backend = registry.backend(name)
    except BackendNotFoundError as exc:
        pytest.skip(str(exc))
    availability = registry.backends[backend.name].availability
    if not availability.available:
        pytest.skip(f"{backend.name} unavailable: {availability.reason}")
    return backend


@pytest.fixture
def lamina_backend(lamina_backend_name: str) -> Backend:
    """The installed backend under test; skips with the backend's reason when unavailable."""
    return available_backend(lamina_backend_name)


@pytest.fixture
def lamina_handle(lamina_backend: Backend) -> DeviceHandle:
    """The DeviceHandle of the backend under test."""
    return lamina_backend.handle()


@pytest.fixture(scope="class")
def lamina_collectives(lamina_backend_name: str) -> CollectiveRun:
    """One 2-rank job running every collective the kit checks, shared by a class's tests."""
    from lamina.testing.conformance import run_collectives

    return run_collectives(available_backend(lamina_backend_name))


#: Variables a launcher or user may set that change what ``lamina.init()`` does.
LAUNCH_VARIABLES = (
    "LAMINA_BACKEND",
    "LAMINA_TOPOLOGY",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    # a scheduler's job step (lamina run reads them: lamina.launch)
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURM_PROCID",
    "SLURM_NODEID",
)


@pytest.fixture
def lamina_clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No runtime, process group, launcher variables or lamina overrides, before and after."""
    import torch.distributed as dist

    import lamina
    from lamina.plugins import get_registry

    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    lamina.shutdown()
    if dist.is_available() and dist.is_initialized():  # left behind by a failed test
        dist.destroy_process_group()
    yield
    lamina.shutdown()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    get_registry(reload=True)
