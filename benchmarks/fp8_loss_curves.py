"""Validation-loss curves of the GPT example with compressed gradients, against fp32.

Trains ``examples/train_gpt.py`` (2 ranks, ``lamina run``) ``--steps`` steps once per
variant from the same seed, one after the other (``--variants``, default the first three):

- ``fp32``: the plain DP all-reduce;
- ``fp8-no-feedback``: ``codec=Fp8Codec(error_feedback=False)``;
- ``fp8``: ``codec="fp8"`` (error feedback on);
- ``int8``: the int8 codec plugin (``plugins/int8_codec``, installed), error feedback on.

Each run writes its evaluations (every ``--eval-every`` steps) as JSON lines; this script
reports the final validation losses and their gaps to fp32, writes
``results/fp8_loss_curves.json`` and draws both fp8 curves beside fp32 in
``docs/images/fp8_loss_curves.png``::

    python benchmarks/fp8_loss_curves.py      # about 7 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import write_results

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"fp32": "none", "fp8-no-feedback": "fp8-no-feedback", "fp8": "fp8", "int8": "int8"}
DEFAULT_VARIANTS = "fp32,fp8-no-feedback,fp8"
PICTURE = ROOT / "docs" / "images" / "fp8_loss_curves.png"


def train(codec: str, args: argparse.Namespace, metrics: Path) -> float:
    """One training run; returns its wall time in seconds."""
    cmd = [
        sys.executable,
        "-m",
        "lamina.cli.main",
        "run",
        "--nproc-per-node",
        str(args.ranks),
        str(ROOT / "examples" / "train_gpt.py"),
        "--max-steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--eval-batches",
        str(args.eval_batches),
        "--codec",
        codec,
        "--metrics",
        str(metrics),
    ]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=3600)
    return time.perf_counter() - started


def read_curve(path: Path) -> list[dict[str, float]]:
    """The evaluations one run wrote."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def draw(curves: dict[str, list[dict[str, float]]], path: Path) -> None:
    """Validation loss against step for every variant (matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    styles = {
        "fp32": ("black", "-"),
        "fp8-no-feedback": ("tab:orange", "--"),
        "fp8": ("tab:blue", ":"),
        "int8": ("tab:green", "-."),
    }
    for name, curve in curves.items():
        color, line = styles[name]
        steps = [r["step"] for r in curve]
        axes.plot(steps, [r["val_loss"] for r in curve], line, color=color, label=name, lw=1.6)
    axes.set_xlabel("step")
    axes.set_ylabel("validation loss")
    axes.set_title("GPT example, 2 ranks: compressed gradients (two-phase sums) against fp32")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (300)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (2)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evals (10)")
    parser.add_argument("--eval-batches", type=int, default=8, help="val batches per rank (8)")
    parser.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated, fp32 first, among {', '.join(VARIANTS)} ({DEFAULT_VARIANTS})",
    )
    parser.add_argument("--output", default="fp8_loss_curves.json")
    parser.add_argument("--picture", default=str(PICTURE))
    args = parser.parse_args()
    chosen = args.variants.split(",")
    if chosen[0] != "fp32" or not set(chosen) <= set(VARIANTS):
        parser.error(f"--variants {args.variants!r}: fp32 first, then any of {list(VARIANTS)}")
    curves: dict[str, list[dict[str, float]]] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            codec = VARIANTS[name]
            print(f"== {name} ({args.steps} steps)", flush=True)
            metrics = Path(tmp) / f"{name}.jsonl"
            seconds[name] = train(codec, args, metrics)
            curves[name] = read_curve(metrics)
    final = {name: curve[-1]["val_loss"] for name, curve in curves.items()}
    gaps = {name: final[name] / final["fp32"] - 1.0 for name in final if name != "fp32"}
    print(f"{'variant':18}{'final val loss':>16}{'vs fp32':>10}{'wall s':>9}")
    for name in curves:
        gap = f"{gaps[name]:+.2%}" if name in gaps else ""
        print(f"{name:18}{final[name]:16.4f}{gap:>10}{seconds[name]:9.1f}")
    fields: dict[str, Any] = {
        "steps": args.steps,
        "ranks": args.ranks,
        "eval_every": args.eval_every,
        "eval_batches": args.eval_batches,
        "final_val_loss": final,
        "relative_gap_to_fp32": gaps,
        "wall_seconds": seconds,
        "curves": {n: [[r["step"], r["val_loss"]] for r in c] for n, c in curves.items()},
    }
    write_results("fp8_loss_curves", args.output, fields)
    draw(curves, Path(args.picture))


if __name__ == "__main__":
    main()
