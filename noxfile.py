"""The cross-backend matrix. `nox` with no arguments runs what CI runs.

Each backend session gets its own torch build, because one torch build carries one
accelerator (torch_npu refuses a CUDA build, torch_xla needs its own torch release).
Sessions: lint (ruff), typecheck (mypy), tests(<backend>), docs (the documentation site,
built in strict mode), train (the README's main job: the GPT example on 2 ranks), finetune
(the LoRA example under dp, zero3 and hsdp), smoke (a 2-rank all-reduce).

Which core tests (``tests/``) each backend session runs, by marker (declared in
pyproject.toml, set per module with ``pytestmark``): ``portable`` marks what depends on
the torch build or the installed backends (imports and plugins, graph capture, kernels,
streams, the collectives' forms, DP / ZeRO-3 / HSDP / fp8 equivalence with DDP, plan and
verify, trace), ``multiprocess`` what starts more than one process.

- ``tests(cpu)`` (torch 2.13): all of them, once. Every core test runs here.
- ``tests(xla)`` (torch 2.9, the oldest release lamina supports): ``portable and (not
  multiprocess or cross_release)``: every single-process build-dependent test, and the
  multi-rank ones whose results a torch release can change (``cross_release``: DP / ZeRO-3
  / HSDP / fp8 equal to DDP, the bytes handed to torch.distributed, torchrun's launch),
  also run on a second torch release. The other multi-rank portable tests (the CLI's plan
  and verify, pre-flight, fallbacks, the trace) run their ranks through the same gloo
  calls, already covered there, and run in tests(cpu).
- ``tests(cuda)`` (torch 2.14, the newest) and ``tests(npu)`` (torch_npu beside the CPU
  torch of ``tests(cpu)``): ``portable and not multiprocess``: what an accelerator build
  and an installed vendor package do to imports, plugin discovery, backend selection,
  graph capture and kernels in one process. Their ranks would run the same gloo code as
  the two sessions above, at a minute or more each on two cores.

Every backend session also runs its backend's own tests (conformance kit included).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "docs"]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
#: uv creates the environments and installs into them when it is installed (`pip install
#: nox[uv]`, as the README's test command does): several times faster than pip for the
#: ~6 GB of torch builds the sessions install, and it keeps one cache for all of them.
nox.options.default_venv_backend = "uv|virtualenv"


def pip_setting(name: str) -> list[str]:
    """The values of pip's configuration key ``name`` (``find-links``, ``constraint``) in
    every scope pip reads (environment, user, site, global), in pip's own order."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    values: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.rpartition(".")[2] == name:
            values += [v for v in shlex.split(value.strip("'\"")) if v not in values]
    return values


def uv_follows_pip() -> None:
    """Give uv the local wheel folders, indexes and constraints pip is configured with,
    and pip's habit of taking the best match over all indexes.

    pip reads them from its configuration, uv does not: without them uv would download a
    CUDA build of torch where a CPU wheel of the pinned release lies on disk, or a release
    past the machine's cap. Variables already set win.
    """
    settings = {
        "UV_FIND_LINKS": ",".join(v for v in pip_setting("find-links") if os.path.isdir(v)),
        "UV_EXTRA_INDEX_URL": " ".join(pip_setting("extra-index-url")),
        "UV_CONSTRAINT": " ".join(v for v in pip_setting("constraint") if os.path.isfile(v)),
        "UV_INDEX_STRATEGY": "unsafe-best-match",
    }
    for variable, value in settings.items():
        if value and variable not in os.environ:
            os.environ[variable] = value


uv_follows_pip()

#: Bytecode written at each module's first import in a session, whatever the machine
#: sets: where PYTHONDONTWRITEBYTECODE is set (as here) and nothing is compiled, every
#: process parses torch's sources again (5.3 s per `import torch` instead of 1.7 s), and
#: pytest rewrites every test module's asserts in each worker. Compiling every module at
#: install instead (pip's way, uv's --compile-bytecode) cost 20 s of CPU per torch build
#: for the few hundred modules a session imports (measured): the first `import torch` of a
#: session takes 4.2 s instead.
WRITE_BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}


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
    #: Extras of lamina-core installed beside it.
    extras: str = "test"
    #: Whether the selected core tests include multi-process ones (xdist_flags).
    starts_ranks: bool = True


BACKENDS: dict[str, BackendSession] = {
    "cpu": BackendSession(
        torch=["torch==2.13.0"],
        packages=["plugins/template_backend", "plugins/int8_codec"],
        test_paths=["plugins/template_backend/tests", "plugins/int8_codec/tests"],
        core_tests=None,
        # transformers and peft: the fine-tuning tests train a Hugging Face Llama with LoRA
        extras="test,examples",
    ),
    # CUDA build of torch (brings triton); runs everything that needs no GPU here and the
    # whole backend suite (conformance, Triton kernels, live NVML) on a GPU machine.
    "cuda": BackendSession(
        torch=["torch==2.14.1"],
        packages=["backends/cuda[triton,test]"],
        test_paths=["backends/cuda/tests"],
        core_tests="portable and not multiprocess",
        starts_ranks=False,
    ),
    # torch_xla needs the torch release of its own number; PJRT's CPU client runs the
    # conformance kit and a training step for real on an `xla` device.
    "xla": BackendSession(
        torch=["torch==2.9.0", "torch_xla==2.9.0"],
        packages=["backends/xla[test]"],
        test_paths=["backends/xla/tests"],
        env={"PJRT_DEVICE": "CPU"},
        core_tests="portable and (not multiprocess or cross_release)",
    ),
    # torch_npu beside the CPU torch: without the CANN toolkit this proves the unavailable
    # path end to end (import torch still works, `lamina info` names libhccl.so).
    "npu": BackendSession(
        torch=["torch==2.13.0", "torch_npu==2.13.0"],
        packages=["backends/npu"],
        test_paths=["backends/npu/tests"],
        core_tests="portable and not multiprocess",
        starts_ranks=False,
    ),
}

TOOLS = ["ruff==0.17.6", "mypy==2.4.1"]
#: The cores this process may run on.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2


def xdist_flags(starts_ranks: bool) -> list[str]:
    """pytest-xdist for the core tests: a file's tests in one worker, so that a module's
    shared multi-rank job starts once, handed out in collection order (tests/conftest.py
    puts the slowest modules first).

    One worker per core, and one more where the selection starts ranks: those tests use
    ~1.3 of 2 cores (ranks wait on each other, the emulator's tests on shaped links and
    timeouts) and a third worker fills that (measured 377 s against two workers' 418 s and
    four's 442 s). Single-process tests keep every core busy by themselves: 30 s with two
    workers against 36-45 s with three (measured), each extra worker collecting the suite.
    """
    workers = CORES + 1 if starts_ranks else CORES
    return ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"]


#: Every package whose sources mypy checks (core and each backend).
TYPED_PACKAGES = [
    "core",
    "backends/cuda",
    "backends/npu",
    "backends/xla",
    "plugins/template_backend",
    "plugins/int8_codec",
]


def install_for(session: nox.Session, spec: BackendSession, extras: str | None = None) -> None:
    """torch for the backend first (pinned), then core (with ``extras``, by default the
    backend's) and the backend packages editable."""
    session.install(*spec.torch)
    session.install("-e", f"core[{extras or spec.extras}]")
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
    """mypy --strict on core and every backend package, with the integrations' frameworks
    installed (Lightning, transformers, Accelerate: lamina.integrations subclasses their
    classes, which strict mypy refuses to do from untyped stand-ins)."""
    install_for(session, BACKENDS["cpu"], extras="test,lightning,hf")
    session.install(TOOLS[1])
    session.run("mypy", *[f"{p}/src" for p in TYPED_PACKAGES])


@nox.session
@nox.parametrize("backend", list(BACKENDS), ids=list(BACKENDS))
def tests(session: nox.Session, backend: str) -> None:
    """Core tests (all, or the backend's marked share) plus the backend's own tests."""
    spec = BACKENDS[backend]
    install_for(session, spec)
    env = {**spec.env, **WRITE_BYTECODE}
    session.run("lamina", "info", env=env)
    select = ["-m", spec.core_tests] if spec.core_tests else []
    xdist = xdist_flags(spec.starts_ranks)
    core = ["pytest", "-ra", "--durations=30", *xdist, *select, "tests", *session.posargs]
    session.run(*core, env=env)
    # The backend's own tests verbosely, so the log shows each check that ran or skipped.
    session.run("pytest", "-v", "-ra", *spec.test_paths, *session.posargs, env=env)


@nox.session
def train(session: nox.Session) -> None:
    """The main job: `lamina info`, then the portable GPT example on 2 ranks via `lamina run`.

    Arguments after `--` go to train_gpt.py (default: `--max-steps 200`).
    """
    install_for(session, BACKENDS["cpu"])
    session.run("lamina", "info", env=WRITE_BYTECODE)
    session.run(
        "lamina",
        "run",
        "--nproc-per-node",
        "2",
        "examples/train_gpt.py",
        *(session.posargs or ["--max-steps", "200"]),
        env=WRITE_BYTECODE,
    )


@nox.session
def finetune(session: nox.Session) -> None:
    """examples/finetune_lora.py for a few steps under dp, zero3 and hsdp: the loss must
    fall and the saved adapters must load back with peft (tests/test_finetuning.py's
    example test, which tests(cpu) runs for dp only)."""
    install_for(session, BACKENDS["cpu"])
    session.run(
        "pytest",
        "-v",
        "-ra",
        "tests/test_finetuning.py",
        "-k",
        "example",
        *session.posargs,
        env={**WRITE_BYTECODE, "LAMINA_FINETUNE_STRATEGIES": "dp,zero3,hsdp"},
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
        env=WRITE_BYTECODE,
    )


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml), built in strict mode: a broken link, a missing
    reference, a page outside the nav or a docstring the API reference cannot render fails.

    Installs lamina-core's ``docs`` extra (core/pyproject.toml, where its pins live) and
    ruff, which mkdocstrings formats the signatures with; nothing else: the API reference
    reads core/src statically (griffe), so neither torch nor lamina is installed. The site
    goes to a temporary folder of the session.
    """
    extras = nox.project.load_toml("core/pyproject.toml")["project"]["optional-dependencies"]
    session.install(*extras["docs"], TOOLS[0])
    site = os.path.join(session.create_tmp(), "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})
