"""The cross-backend matrix. `nox` with no arguments runs what CI runs.

Each backend session gets its own torch build, because one torch build carries one
accelerator (torch_npu refuses a CUDA build, torch_xla needs its own torch release).
Sessions: lint (ruff), typecheck (mypy), tests(<backend>), train (the README's main job:
the GPT example on 2 ranks), smoke (a 2-rank all-reduce).

Which core tests (``tests/``) each backend session runs, by marker (declared in
pyproject.toml, set per module with ``pytestmark``):

- ``tests(cpu)``: all of them, once (every core test runs here at least).
- ``tests(xla)``: ``portable or multiprocess``: what depends on the torch build or the
  installed backends (imports and plugins, graph capture, kernels, streams, DP and ZeRO-3
  equivalence with DDP, plan and verify, trace), and every test that starts real ranks,
  so that the equivalence and multi-process tests run on a second torch release (2.9).
- ``tests(cuda)``, ``tests(npu)``: ``portable``.

Every backend session also runs its backend's own tests (conformance kit included).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True


@dataclass(frozen=True)
class BackendSession:
    """What one backend's test session installs, sets and runs."""

    #: The torch build (and vendor runtime) for this accelerator, pinned.
    torch: list[str]
    #: Backend and plugin packages installed editable beside core.
    packages: list[str] = field(default_factory=list)
    #: Test paths beyond the core suite in tests/.
    test_paths: list[str] = field(default_factory=list)
    #: Environment for the tests.
    env: dict[str, str] = field(default_factory=dict)
    #: pytest ``-m`` expression selecting the core tests to run (None: all of them).
    core_tests: str | None = "portable"


BACKENDS: dict[str, BackendSession] = {
    "cpu": BackendSession(
        torch=["torch==2.13.0"],
        packages=["plugins/template_backend"],
        test_paths=["plugins/template_backend/tests"],
        core_tests=None,
    ),
    # CUDA build of torch (brings triton); runs everything that needs no GPU here and the
    # whole backend suite (conformance, Triton kernels, live NVML) on a GPU machine.
    "cuda": BackendSession(
        torch=["torch==2.14.1"],
        packages=["backends/cuda[triton,test]"],
        test_paths=["backends/cuda/tests"],
    ),
    # torch_xla needs the torch release of its own number; PJRT's CPU client runs the
    # conformance kit and a training step for real on an `xla` device.
    "xla": BackendSession(
        torch=["torch==2.9.0", "torch_xla==2.9.0"],
        packages=["backends/xla[test]"],
        test_paths=["backends/xla/tests"],
        env={"PJRT_DEVICE": "CPU"},
        core_tests="portable or multiprocess",
    ),
    # torch_npu beside the CPU torch: without the CANN toolkit this proves the unavailable
    # path end to end (import torch still works, `lamina info` names libhccl.so).
    "npu": BackendSession(
        torch=["torch==2.13.0", "torch_npu==2.13.0"],
        packages=["backends/npu"],
        test_paths=["backends/npu/tests"],
    ),
}

TOOLS = ["ruff==0.17.6", "mypy==2.4.1"]
#: pytest-xdist for the core tests: one worker per core (at most 4), a file's tests in one
#: worker so that a module's shared 2-rank job starts once. Most of a multi-process test
#: is waiting on other processes, so two workers on two cores finish ~25% sooner.
PARALLEL = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile"]
#: Every package whose sources mypy checks (core and each backend).
TYPED_PACKAGES = [
    "core",
    "backends/cuda",
    "backends/npu",
    "backends/xla",
    "plugins/template_backend",
]


def install_for(session: nox.Session, spec: BackendSession) -> None:
    """torch for the backend first (pinned), then core and the backend packages editable."""
    session.install(*spec.torch)
    session.install("-e", "core[test]")
    for package in spec.packages:
        session.install("-e", package)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install(TOOLS[0])
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on core and every backend package."""
    install_for(session, BACKENDS["cpu"])
    session.install(TOOLS[1])
    session.run("mypy", *[f"{p}/src" for p in TYPED_PACKAGES])


@nox.session
@nox.parametrize("backend", list(BACKENDS), ids=list(BACKENDS))
def tests(session: nox.Session, backend: str) -> None:
    """Core tests (all, or the backend's marked share) plus the backend's own tests."""
    spec = BACKENDS[backend]
    install_for(session, spec)
    session.run("lamina", "info", env=spec.env)
    select = ["-m", spec.core_tests] if spec.core_tests else []
    core = ["pytest", "-ra", "--durations=5", *PARALLEL, *select, "tests", *session.posargs]
    session.run(*core, env=spec.env)
    # The backend's own tests verbosely, so the log shows each check that ran or skipped.
    session.run("pytest", "-v", "-ra", *spec.test_paths, *session.posargs, env=spec.env)


@nox.session
def train(session: nox.Session) -> None:
    """The main job: `lamina info`, then the portable GPT example on 2 ranks via `lamina run`.

    Arguments after `--` go to train_gpt.py (default: `--max-steps 200`).
    """
    install_for(session, BACKENDS["cpu"])
    session.run("lamina", "info")
    session.run(
        "lamina",
        "run",
        "--nproc-per-node",
        "2",
        "examples/train_gpt.py",
        *(session.posargs or ["--max-steps", "200"]),
    )


@nox.session
def smoke(session: nox.Session) -> None:
    """A 2-rank all-reduce under torchrun: the quickest check that a machine works."""
    install_for(session, BACKENDS["cpu"])
    session.run(
        "python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/smoke_allreduce.py",
        *session.posargs,
    )
