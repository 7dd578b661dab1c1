"""The ``lamina`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console

from lamina.cli.bench import add_bench_parsers
from lamina.cli.checkpoint import add_checkpoint_parser
from lamina.cli.emulate import add_emulate_parser
from lamina.cli.plan import add_plan_parsers
from lamina.cli.plugin import add_plugin_parser
from lamina.cli.run import add_run_parser
from lamina.cli.topo import add_topo_parser
from lamina.cli.trace import add_trace_parser
from lamina.errors import LaminaError


def _cmd_info(args: argparse.Namespace) -> int:
    from lamina.cli.info import collect_info, render_info
    from lamina.plugins import get_registry

    report = collect_info(get_registry())
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        render_info(report, Console())
    return 0 if report["selected_backend"] else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``lamina`` subcommand."""
    parser = argparse.ArgumentParser(
        prog="lamina", description="Portable, static-graph distributed training for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="installed plugins, backends, devices and topology")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.set_defaults(func=_cmd_info)
    add_run_parser(sub)
    add_plan_parsers(sub)
    add_trace_parser(sub)
    add_bench_parsers(sub)
    add_plugin_parser(sub)
    add_emulate_parser(sub)
    add_topo_parser(sub)
    add_checkpoint_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lamina`` console script."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except LaminaError as exc:
        print(f"lamina: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
