"""The cross-backend matrix. `nox` with no arguments runs what CI runs.

Each backend session gets its own torch build, because one torch build carries one
accelerator. Sessions: lint (ruff), typecheck (mypy on core), tests(<backend>), smoke
(the README's main job: `lamina info` and a 2-rank run under torchrun).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

#: The torch build each backend session installs (one accelerator per torch build).
TORCH_FOR_BACKEND = {
    "cpu": ["torch==2.13.0"],
}

TOOLS = ["ruff==0.17.6", "mypy==2.4.1"]


def install_core(session: nox.Session, backend: str) -> None:
    """torch for ``backend`` first (pinned), then lamina-core editable with test extras."""
    session.install(*TORCH_FOR_BACKEND[backend])
    session.install("-e", "core[test]")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install(*TOOLS[:1])
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the core package."""
    install_core(session, "cpu")
    session.install(*TOOLS[1:])
    session.run("mypy")


@nox.session
@nox.parametrize("backend", list(TORCH_FOR_BACKEND), ids=list(TORCH_FOR_BACKEND))
def tests(session: nox.Session, backend: str) -> None:
    """Unit, multi-process (gloo) and conformance tests with ``backend``'s torch build."""
    install_core(session, backend)
    session.run("lamina", "info")
    session.run("pytest", "-ra", "--durations=10", *session.posargs)


@nox.session
def smoke(session: nox.Session) -> None:
    """The main job until the training engine lands: `lamina info` and a 2-rank run."""
    install_core(session, "cpu")
    session.run("lamina", "info")
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
