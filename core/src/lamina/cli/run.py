"""``lamina run``: torchrun (``torch.distributed.run``) plus ``--backend``.

Every torchrun flag passes through unchanged and torchrun parses it, so its errors and
its help stay authoritative. lamina adds: ``--backend NAME`` (checked against the
installed backends before any rank starts, then exported as ``LAMINA_BACKEND`` to every
rank); under a scheduler (SLURM, a Kubernetes PyTorchJob pod) the rendezvous flags its
environment implies (:mod:`lamina.launch`), for those the user did not give; for a
single-node job that names no rendezvous, ``--standalone``, so that two jobs on one
machine never fight over port 29500; and a one-line error for a script that does not
exist, before any rank starts. Nothing is spawned here: torchrun launches, monitors and
restarts the ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lamina.envvars import BACKEND_ENV
from lamina.errors import ConfigError
from lamina.launch import NodeLaunch, detect

#: The subcommand's own flag; everything else belongs to torchrun.
BACKEND_FLAG = "--backend"

#: torchrun destinations that mean "the user chose the rendezvous": no --standalone then.
_RENDEZVOUS_DESTS = ("rdzv_endpoint", "rdzv_backend", "master_port", "master_addr")
#: What a scheduler's environment can fill in (flags the user gives win).
_PLACEMENT_DESTS = (*_RENDEZVOUS_DESTS, "nnodes", "node_rank", "nproc_per_node", "standalone")

_DESCRIPTION = """\
Launch SCRIPT on every rank with torchrun (torch.distributed.run); not a new launcher.

Every torchrun flag below is accepted and passed through unchanged. lamina adds:
  --backend NAME  checked against the installed backends before anything starts, then
                  exported to every rank as LAMINA_BACKEND (see `lamina info`).
  --standalone    added for you when --nnodes is 1 and none of --standalone,
                  --rdzv-endpoint, --rdzv-backend, --master-addr or --master-port is
                  given (nor their PET_* variables), so two jobs on one machine do not
                  collide on port 29500.
Under SLURM (srun) or in a Kubernetes PyTorchJob pod, --nnodes, --node-rank,
--master-addr and --master-port (and --nproc-per-node 1 with one SLURM task per rank)
come from the scheduler's environment, unless given; see docs/multi-node.md.
--nproc-per-node defaults to 1, as in torchrun.

example: lamina run --nproc-per-node 2 --backend cpu examples/train_gpt.py --max-steps 30
"""


@dataclass(frozen=True)
class LaunchPlan:
    """What ``lamina run`` will do: the backend to export and torchrun's argv."""

    backend: str | None
    torchrun_argv: list[str]
    added_standalone: bool
    #: Where the scheduler's environment placed this agent (None: no scheduler).
    scheduler: NodeLaunch | None = None
    #: The script file every rank runs (None with ``-m`` or ``--no-python``).
    script: str | None = None


def build_run_parser(prog: str = "lamina run") -> argparse.ArgumentParser:
    """torchrun's own parser with ``--backend`` added (used for help and inspection)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    group = parser.add_argument_group("lamina")
    group.add_argument(
        BACKEND_FLAG,
        metavar="NAME",
        default=None,
        help=f"lamina backend for every rank (sets {BACKEND_ENV}); default: "
        f"${BACKEND_ENV}, else the best available backend",
    )
    return parser


def _is_backend_flag(token: str) -> bool:
    """True for ``--backend``, ``--backend=X`` and argparse's abbreviations (``--back``)."""
    name = token.split("=", 1)[0]
    return len(name) > 2 and BACKEND_FLAG.startswith(name)


def strip_backend(argv: Sequence[str], n_script_tokens: int) -> list[str]:
    """``argv`` without the ``--backend`` flags that precede the script.

    ``n_script_tokens`` is the number of trailing tokens (script and its arguments) that
    belong to the script and are never touched.
    """
    split = len(argv) - n_script_tokens
    kept: list[str] = []
    skip_value = False
    for token in argv[:split]:
        if skip_value:
            skip_value = False
        elif _is_backend_flag(token):
            skip_value = "=" not in token
        else:
            kept.append(token)
    return kept + list(argv[split:])


def _explicit(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    dests: Sequence[str] = _RENDEZVOUS_DESTS,
) -> set[str]:
    """The ``dests`` given on the command line or as torchrun's ``PET_*`` variables."""
    parser.set_defaults(**{dest: None for dest in dests})
    namespace = parser.parse_args(list(argv))
    given = {d for d in dests if getattr(namespace, d, None) not in (None, "", False)}
    given |= {d for d in dests if os.environ.get(f"PET_{d.upper()}")}
    return given


def check_script(script: str | None) -> None:
    """A script that does not exist is one line here, not a failure on every rank."""
    if script is not None and not os.path.isfile(script):
        raise ConfigError(
            f"script {script!r} does not exist; pass the path of a Python file (or -m MODULE)"
        )


def _single_node(nnodes: str) -> bool:
    from torch.distributed.run import parse_min_max_nnodes

    try:
        _, max_nodes = parse_min_max_nnodes(nnodes)
    except (ValueError, RuntimeError):
        return False  # torchrun reports the malformed value itself
    return bool(max_nodes == 1)


def plan_launch(argv: Sequence[str], environ: dict[str, str] | None = None) -> LaunchPlan:
    """Parse ``lamina run`` arguments into a :class:`LaunchPlan` (argparse exits on
    errors); ``environ`` (default: this process's) is read for a scheduler's placement."""
    parser = build_run_parser()
    args: Any = parser.parse_args(list(argv))
    script = None if args.module or args.no_python else str(args.training_script)
    script_tokens = 1 + len(args.training_script_args)
    torchrun_argv = strip_backend(argv, script_tokens)
    given = _explicit(build_run_parser(), argv, _PLACEMENT_DESTS)
    scheduler = None
    if not given & {"standalone", "rdzv_endpoint", "rdzv_backend"}:
        scheduler = detect(dict(os.environ) if environ is None else environ)
    if scheduler is not None:
        torchrun_argv[:0] = scheduler.torchrun_flags(given)
        return LaunchPlan(args.backend, torchrun_argv, False, scheduler, script)
    add_standalone = (
        not args.standalone and _single_node(args.nnodes) and not (given & set(_RENDEZVOUS_DESTS))
    )
    if add_standalone:
        torchrun_argv.insert(0, "--standalone")
    return LaunchPlan(args.backend, torchrun_argv, add_standalone, None, script)


#: ``--nproc-per-node`` values that mean "one rank per visible device".
PER_DEVICE = ("gpu", "auto")


def fit_ranks_to_devices(plan: LaunchPlan, backend_name: str | None) -> LaunchPlan:
    """For a backend that gives each rank a device of its own: ``--nproc-per-node gpu``
    (or ``auto``) becomes the visible device count, and more ranks than devices is one
    line here (:func:`lamina.device.sharing.check_ranks_fit`) before any rank starts."""
    args: Any = build_run_parser().parse_args(plan.torchrun_argv)
    nproc = str(args.nproc_per_node)
    if nproc not in PER_DEVICE and not (nproc.isdigit() and int(nproc) > 1):
        return plan
    from lamina.device.sharing import check_ranks_fit
    from lamina.plugins import get_registry

    backend = get_registry().select_backend(backend_name)
    if not backend.one_device_per_rank:
        if nproc == "gpu":
            raise ConfigError(
                f"--nproc-per-node gpu starts one rank per device, but backend "
                f"{backend.name!r} has no devices of its own; give a number of ranks"
            )
        return plan  # "auto": torchrun's own rule
    devices = backend.handle().device_count()
    if nproc.isdigit():
        check_ranks_fit(backend, int(nproc), devices)
        return plan
    if devices < 1:
        raise ConfigError(
            f"--nproc-per-node {nproc}: no {backend.name} device is visible; check "
            f"{backend.visible_devices_env or 'the driver'}"
        )
    split = len(plan.torchrun_argv) - 1 - len(args.training_script_args)
    argv = [*plan.torchrun_argv[:split], f"--nproc-per-node={devices}"]
    return dataclasses.replace(plan, torchrun_argv=argv + plan.torchrun_argv[split:])


def check_backend(name: str) -> str:
    """Fail before any rank starts if backend ``name`` is not installed or not available."""
    from lamina.plugins import get_registry

    return get_registry().select_backend(name).name


def launch(plan: LaunchPlan) -> int:
    """Hand ``plan`` to torchrun in this process; the exit status of the job."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    saved = os.environ.get(BACKEND_ENV)
    if plan.backend is not None:
        os.environ[BACKEND_ENV] = plan.backend
    try:
        torchrun_main(plan.torchrun_argv)
    except ChildFailedError as exc:
        print(f"lamina run: {exc}", file=sys.stderr)
        _rank, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        if saved is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = saved
    return 0


def launch_module(
    module: str, module_args: Sequence[str], nproc_per_node: int | None, backend: str | None
) -> int:
    """Run ``python -m module module_args`` on every rank, as ``lamina run`` would: on one
    node ``--standalone``, under a scheduler its rendezvous (``lamina bench``, ``lamina
    topo probe`` and the like)."""
    if nproc_per_node is not None and nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    nproc = [] if nproc_per_node is None else ["--nproc-per-node", str(nproc_per_node)]
    plan = plan_launch([*nproc, "-m", module, *module_args])
    return launch(dataclasses.replace(plan, backend=backend))


def add_nproc_argument(parser: argparse.ArgumentParser) -> None:
    """``--nproc-per-node N`` of a command that launches ranks (default: one, or one per
    task under SLURM's one task per rank)."""
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="ranks on this node (default 1, or one per task under SLURM's one task per rank)",
    )


def run_command(args: argparse.Namespace) -> int:
    """The ``lamina run`` subcommand: plan, check the backend, launch with torchrun."""
    argv: list[str] = list(args.run_argv)
    try:
        plan = plan_launch(argv)
    except SystemExit as exc:  # --help, or torchrun's own usage error
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    requested = plan.backend if plan.backend is not None else os.environ.get(BACKEND_ENV)
    if requested:
        check_backend(requested.strip())
    check_script(plan.script)
    plan = fit_ranks_to_devices(plan, requested.strip() if requested else None)
    if plan.scheduler is not None:
        print(f"lamina run: {plan.scheduler.describe()}", file=sys.stderr, flush=True)
    return launch(plan)


def add_run_parser(subparsers: Any) -> None:
    """Register ``run`` on the ``lamina`` subcommand parsers.

    The subparser takes every token verbatim (no option prefix characters, no ``-h``)
    so that torchrun's flags, ``--help`` included, reach :func:`run_command` untouched.
    """
    parser = subparsers.add_parser(
        "run",
        help="launch a script on every rank (torchrun flags, plus --backend)",
        description="Run `lamina run --help` for the options.",
        add_help=False,
        prefix_chars="\x00",
    )
    parser.add_argument("run_argv", nargs=argparse.REMAINDER, metavar="ARGS")
    parser.set_defaults(func=run_command)


__all__ = [
    "BACKEND_FLAG",
    "LaunchPlan",
    "add_run_parser",
    "build_run_parser",
    "check_backend",
    "launch",
    "plan_launch",
    "run_command",
    "strip_backend",
]
