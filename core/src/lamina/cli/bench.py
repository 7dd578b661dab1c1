"""``lamina bench collectives``: an nccl-tests-style sweep on the current backend.

Launches ``python -m lamina.bench.collectives`` on ``--nproc-per-node`` ranks with
torchrun (through ``lamina run``'s launch planning, so under SLURM or ``lamina emulate``
it joins the job's rendezvous on every host); rank 0 prints the table (size, op, time,
algbw, busbw) as it goes and writes ``--json`` when given.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from lamina.bench.sweep_options import add_sweep_arguments, check_sweep_arguments
from lamina.cli.run import add_nproc_argument, check_backend, launch_module
from lamina.envvars import BACKEND_ENV

#: The module every rank runs.
RANK_MODULE = "lamina.bench.collectives"


def collectives_command(args: argparse.Namespace) -> int:
    """Validate the options before any rank starts, then launch the sweep."""
    check_sweep_arguments(args)
    requested = args.backend or os.environ.get(BACKEND_ENV)
    if requested:
        check_backend(requested.strip())
    forwarded = [
        "--ops",
        *args.ops,
        "--min-bytes",
        args.min_bytes,
        "--max-bytes",
        args.max_bytes,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
    ]
    if args.json:
        forwarded += ["--json", str(Path(args.json).resolve())]
    if args.algorithm:
        forwarded += ["--algorithm", *args.algorithm]
    if args.no_calibrate:
        forwarded.append("--no-calibrate")
    return launch_module(RANK_MODULE, forwarded, args.nproc_per_node, args.backend)


def add_bench_parsers(subparsers: Any) -> None:
    """Register ``bench`` (with its ``collectives`` subcommand) on the ``lamina`` parsers."""
    bench = subparsers.add_parser("bench", help="micro-benchmarks on this job's devices and links")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    sweep = kinds.add_parser(
        "collectives",
        help="time all_reduce, reduce_scatter, all_gather, all_to_all, broadcast over sizes",
        description="Sweep the collectives over power-of-two sizes on N ranks of the current "
        "backend (nccl-tests style): time, algbw and busbw per op and size.",
    )
    add_nproc_argument(sweep)
    sweep.add_argument("--backend", default=None, metavar="NAME", help="lamina backend")
    add_sweep_arguments(sweep)
    sweep.set_defaults(func=collectives_command)
