"""``lamina emulate``: run a job on an emulated multi-host cluster (see lamina.emulate)."""

from __future__ import annotations

import argparse
from typing import Any

from lamina.errors import ConfigError

_EPILOG = """\
Each host is a network namespace with its own host name; hosts reach each other only
through their shaped uplink (tc: a token bucket at RATE, netem for delay and loss), ranks
on one host through its loopback. Every host starts its share of the job as a SLURM job
step would, through `lamina run`. Needs root. Namespaces are always removed; those of a
killed run are removed by the next one.

example:
  lamina emulate --hosts 2 --nproc-per-host 2 --link 200mbit --rank-order interleaved \\
      -- examples/train_gpt.py --max-steps 20
"""


def _emulate_command(args: argparse.Namespace) -> int:
    from lamina.emulate import EmulateOptions, parse_link, run_emulated
    from lamina.emulate.faults import parse_fault

    fault = None
    if args.fault is not None:
        fault = parse_fault(args.fault, args.hosts, args.fault_at, args.fault_on)
    elif args.fault_at is not None or args.fault_on is not None:
        raise ConfigError("--fault-at / --fault-on need --fault KIND:HOST (cut:1 or kill:1)")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    options = EmulateOptions(
        hosts=args.hosts,
        nproc_per_host=args.nproc_per_host,
        link=parse_link(args.link),
        command=tuple(command),
        rank_order=args.rank_order,
        timeout_s=args.timeout,
        fault=fault,
    )
    return run_emulated(options)


def add_emulate_parser(subparsers: Any) -> None:
    """Register ``emulate`` on the ``lamina`` subcommand parsers."""
    parser = subparsers.add_parser(
        "emulate",
        help="run a job on an emulated multi-host cluster (network namespaces + tc; root)",
        description="Run COMMAND on HOSTS emulated hosts joined by shaped links.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hosts", type=int, required=True, help="number of emulated hosts")
    parser.add_argument(
        "--nproc-per-host", type=int, default=1, help="ranks on each host (default 1)"
    )
    parser.add_argument(
        "--link",
        required=True,
        metavar="RATE[,delay=D][,loss=L]",
        help="each host's uplink, both directions, e.g. 200mbit or 1gbit,delay=2ms,loss=0.1%%",
    )
    parser.add_argument(
        "--rank-order",
        choices=("ordered", "interleaved"),
        default="ordered",
        help="ordered: host h runs ranks h*P..h*P+P-1; interleaved: ranks round-robin "
        "across hosts (srun --distribution=cyclic)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before every host is stopped"
    )
    parser.add_argument(
        "--fault",
        metavar="KIND:HOST",
        default=None,
        help="inject a fault: cut:H takes host H's link down, kill:H kills every process on host H",
    )
    parser.add_argument(
        "--fault-at", type=float, default=None, metavar="S", help="fire it S seconds in"
    )
    parser.add_argument(
        "--fault-on",
        default=None,
        metavar="TEXT",
        help="fire it when a task first prints a line containing TEXT (e.g. 'step 3')",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ARGS",
        help="a Python script (started with lamina run) or a lamina command line",
    )
    parser.set_defaults(func=_emulate_command)
