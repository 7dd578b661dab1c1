"""``lamina checkpoint ls | verify | diff | export``: look into CheckpointManager
checkpoints offline (no process group; one machine).

The logic is :mod:`lamina.checkpoint.inspect`; this module parses and prints. Exit
codes: 0 fine; 1 ``verify`` found a bad step or ``diff`` found a difference; 2 bad
input (missing directory, unknown step, a checkpoint that fails its checks where a
command needs to read it, safetensors not installed).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from lamina.errors import ConfigError


def ls_command(args: argparse.Namespace) -> int:
    """One line per step directory under DIR."""
    from lamina.checkpoint.inspect import format_age, list_steps
    from lamina.units import format_bytes

    root = Path(args.directory)
    steps = list_steps(root)
    if not steps:
        print(f"{root}: no step directories")
        return 0
    print(
        f"{'step':>8}  {'state':30}  {'ranks':>5}  {'strategy':10}  {'layout':18}  "
        f"{'size':>10}  age"
    )
    for info in steps:
        ranks = str(info.world_size) if info.world_size is not None else "-"
        print(
            f"{info.step:>8}  {info.state:30}  {ranks:>5}  {info.strategy or '-':10}  "
            f"{info.layout or '-':18}  {format_bytes(info.total_bytes):>10}  "
            f"{format_age(info.written)}"
        )
    return 0


def verify_command(args: argparse.Namespace) -> int:
    """Manifest and every file's size and sha256 of one step."""
    from lamina.checkpoint.inspect import resolve_step, verify_step
    from lamina.units import format_bytes

    directory = resolve_step(Path(args.directory), args.step)
    try:
        manifest = verify_step(directory)
    except ConfigError as exc:
        print(f"lamina checkpoint verify: FAILED: {exc}", file=sys.stderr)
        return 1
    print(
        f"OK {directory.name}: {len(manifest.files)} files, {format_bytes(manifest.total_bytes)}"
        f" (world size {manifest.world_size}, strategy {manifest.strategy})"
    )
    return 0


def _format_diff(value: float | None) -> str:
    if value is None:
        return ""
    return "nan" if math.isnan(value) else f"{value:.6g}"


def diff_command(args: argparse.Namespace) -> int:
    """Every tensor and value of two steps, compared bitwise."""
    from lamina.checkpoint.inspect import (
        diff_states,
        load_flat,
        resolve_step,
        unwrap_names,
        verify_step,
    )

    loaded: list[dict[str, Any]] = []
    dirs = []
    for given in (args.a, args.b):
        directory = resolve_step(Path(given), args.step)
        loaded.append(unwrap_names(load_flat(directory, verify_step(directory))))
        dirs.append(directory)
    print(f"A: {dirs[0]}")
    print(f"B: {dirs[1]}")
    rows = diff_states(loaded[0], loaded[1])
    shown = [r for r in rows if r.is_tensor or not r.equal]
    width = max((len(r.name) for r in shown), default=0)
    for row in shown:
        if row.status == "equal":
            text = "equal (bitwise)"
        elif row.status == "differs" and row.is_tensor:
            text = f"max abs diff {_format_diff(row.max_abs)}"
        else:
            text = row.status + (f": {row.detail}" if row.detail else "")
        print(f"  {row.name:{width}}  {text}")
    tensors = [r for r in rows if r.is_tensor]
    values = [r for r in rows if not r.is_tensor]
    differing = [r for r in rows if not r.equal]
    verdict = "identical"
    if differing:
        verdict = f"{len(differing)} differ"
        numeric = [(r.max_abs, r.name) for r in tensors if r.max_abs is not None and not r.equal]
        model = [pair for pair in numeric if pair[1].startswith("model.")] or numeric
        if model:
            top, name = max(model, key=lambda pair: math.inf if math.isnan(pair[0]) else pair[0])
            verdict += f"; largest: {name} max abs diff {_format_diff(top)}"
    print(
        f"{sum(r.equal for r in tensors)}/{len(tensors)} tensors bitwise equal, "
        f"{sum(r.equal for r in values)}/{len(values)} other entries equal; {verdict}"
    )
    return 0 if not differing else 1


def export_command(args: argparse.Namespace) -> int:
    """The step's full model state as a .safetensors file."""
    from lamina.checkpoint.inspect import export_model, resolve_step, verify_step
    from lamina.units import format_bytes

    out = Path(args.output)
    directory = resolve_step(Path(args.directory), args.step)
    count, skipped = export_model(directory, verify_step(directory), out)
    print(f"wrote {out}: {count} tensors, {format_bytes(out.stat().st_size)} from {directory}")
    if skipped:
        print(f"skipped {len(skipped)} non-tensor model entries: {', '.join(skipped)}")
    return 0


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--step must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--step must be >= 0, got {value}")
    return value


def add_checkpoint_parser(subparsers: Any) -> None:
    """Register ``checkpoint`` (ls, verify, diff, export) on the ``lamina`` parsers."""
    checkpoint = subparsers.add_parser(
        "checkpoint", help="list, verify, compare and export checkpoints (offline)"
    )
    kinds = checkpoint.add_subparsers(dest="checkpoint_command", required=True, metavar="COMMAND")
    ls = kinds.add_parser(
        "ls",
        help="list the step directories of a checkpoint directory",
        description="One line per step directory (committed and never committed): state, "
        "world size, strategy, size, age. Reads the manifests only.",
    )
    ls.add_argument("directory", metavar="DIR", help="the directory given to CheckpointManager")
    ls.set_defaults(func=ls_command)
    step_help = "step to use (default: the latest committed)"
    verify = kinds.add_parser(
        "verify",
        help="check a step's manifest and every file's size and sha256",
        description="Check the manifest and every file of one committed step against their "
        "recorded size and sha256, and that no other file lies there. Exit 1 when not.",
    )
    verify.add_argument("directory", metavar="DIR", help="checkpoint directory or step directory")
    verify.add_argument("--step", type=_step, default=None, metavar="N", help=step_help)
    verify.set_defaults(func=verify_command)
    diff = kinds.add_parser(
        "diff",
        help="compare every tensor and value of two checkpoints (exit 1 if any differs)",
        description="Verify both steps, load every tensor in full (shards joined) and print "
        "each one's max abs difference; exit 0 only when everything is bitwise equal.",
    )
    diff.add_argument("a", metavar="A", help="checkpoint directory or step directory")
    diff.add_argument("b", metavar="B", help="checkpoint directory or step directory")
    diff.add_argument(
        "--step", type=_step, default=None, metavar="N", help="step in both (default: latest)"
    )
    diff.set_defaults(func=diff_command)
    export = kinds.add_parser(
        "export",
        help="write a step's full model state as .safetensors",
        description="Verify the step and write its model tensors, unsharded and under their "
        "original parameter names, to a safetensors file (needs lamina-core[export]).",
    )
    export.add_argument("directory", metavar="DIR", help="checkpoint directory or step directory")
    export.add_argument("--step", type=_step, default=None, metavar="N", help=step_help)
    export.add_argument("output", metavar="OUT", help="the .safetensors file to write")
    export.set_defaults(func=export_command)
