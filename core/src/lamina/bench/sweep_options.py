"""The options of a collectives sweep and their checks: no torch, so that the ``lamina``
command parses and rejects them before it imports torch or starts a rank."""

from __future__ import annotations

import argparse
import re

from lamina.errors import ConfigError

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536 (K, M, G are powers of 1024; ``KiB``/``KB`` also read)."""
    match = _SIZE.match(text)
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(f"size {text!r} is not a positive byte count like 1K, 256M or 4096")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def sweep_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """``min_bytes``, doubled while it stays <= ``max_bytes``."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ConfigError(
            f"--min-bytes {min_bytes} and --max-bytes {max_bytes} give no sizes; "
            "use 1 <= min <= max"
        )
    sizes = [min_bytes]
    while sizes[-1] * 2 <= max_bytes:
        sizes.append(sizes[-1] * 2)
    return sizes


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's options (shared by ``lamina bench collectives`` and the rank module)."""
    parser.add_argument(
        "--ops",
        nargs="+",
        choices=OPS,
        default=list(OPS),
        metavar="OP",
        help=f"collectives to sweep (default: all of {', '.join(OPS)})",
    )
    parser.add_argument("--min-bytes", default="1K", metavar="SIZE", help="smallest (1K)")
    parser.add_argument("--max-bytes", default="256M", metavar="SIZE", help="largest (256M)")
    parser.add_argument("--iters", type=int, default=5, metavar="N", help="timed calls (5)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed calls (2)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results here")
    parser.add_argument(
        "--algorithm",
        nargs="+",
        default=None,
        metavar="NAME",
        help="time all-reduce algorithms instead of the ops, beside the cost model's "
        "prediction: flat, ordered, hierarchical, pipelined, auto or all",
    )
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="with --algorithm: predict from the topology's links, not from phases timed first",
    )


def check_sweep_arguments(args: argparse.Namespace) -> list[int]:
    """Validate the sweep options; the sizes to run."""
    if args.iters < 1:
        raise ConfigError(f"--iters must be >= 1, got {args.iters}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    if args.algorithm:
        from lamina.bench.algorithms import requested

        requested(args.algorithm)
    return sweep_sizes(parse_size(args.min_bytes), parse_size(args.max_bytes))
