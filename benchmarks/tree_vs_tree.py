"""One benchmark on two source trees, alternating, in one sitting: did a refactor move it?

``--old REF`` is checked out into a temporary git worktree; each round runs the benchmark
script once per tree, the order flipped every round (old, new, then new, old, ...), each
run with ``PYTHONPATH`` putting that tree's ``core/src`` first, so that the machine's
drift falls on both alike. Every ratio field the benchmark writes (``*_over_*`` per
workload, e.g. ``lamina_over_ddp``) is collected; the table shows each tree's median
over the rounds and new/old, and ``results/tree_vs_tree_<benchmark>.json`` keeps every
round::

    python benchmarks/tree_vs_tree.py --old 39a5063 --rounds 2 dp_vs_ddp.py --rounds 3
    python benchmarks/tree_vs_tree.py --old 39a5063 zero3_vs_fsdp2.py --only mlp
    python benchmarks/tree_vs_tree.py --old 39a5063 --result tp_vs_torch_loopback.json \
        tp_vs_torch.py --rounds 2

Arguments after the script name go to the benchmark. The benchmark's own result file is
written into a temporary directory of each tree, not over the committed results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import write_results

ROOT = Path(__file__).resolve().parent.parent


def worktree(ref: str, where: Path) -> Path:
    """``ref`` checked out at ``where`` (a detached git worktree)."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref],
        check=True,
        capture_output=True,
        text=True,
    )
    return where


def run_once(
    tree: Path, script: str, args: list[str], output: Path, result: str | None = None
) -> dict[str, Any]:
    """The benchmark ``script`` of ``tree`` once; the JSON it wrote. ``result``: the file
    of ``results/`` a benchmark without ``--output`` writes (read, then put back as git
    has it, so the committed results stay)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "core" / "src"), str(tree)])}
    results = tree / "benchmarks" / "results"
    name = result or f"tree_vs_tree_{os.getpid()}_{output.stem}.json"
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args]
    if result is None:
        cmd += ["--output", name]
    subprocess.run(cmd, check=True, cwd=tree, env=env, timeout=3600)
    written = results / name
    data: dict[str, Any] = json.loads(written.read_text())
    if result is None:
        written.unlink()
    else:
        restore = ["git", "-C", str(tree), "checkout", "--", f"benchmarks/results/{name}"]
        subprocess.run(restore, check=False, capture_output=True)
    return data


def _time_ratio(key: str, value: object) -> bool:
    return "_over_" in key and "_peak_rss" not in key and isinstance(value, float)


def ratios(data: dict[str, Any]) -> dict[str, float]:
    """``workload.a_over_b`` -> ratio, for every time ratio the benchmark wrote: per
    workload (``results``), at the top level, or in a ``ratios`` table."""
    out = {}
    for workload, fields in (data.get("results") or {}).items():
        for key, value in fields.items():
            if _time_ratio(key, value):
                out[f"{workload}.{key}"] = value
    for key, value in {**data, **(data.get("ratios") or {})}.items():
        if _time_ratio(key, value):
            out[key] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the git ref of the old tree")
    parser.add_argument("--rounds", type=int, default=2, help="alternations (2)")
    parser.add_argument(
        "--result", help="for a benchmark without --output: the results/ file it writes"
    )
    parser.add_argument("script", help="the benchmark, e.g. dp_vs_ddp.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args()
    if not (ROOT / "benchmarks" / args.script).is_file():
        parser.error(f"no benchmark {args.script!r} in {ROOT / 'benchmarks'}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    per_tree: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        old = worktree(args.old, Path(tmp) / "old")
        try:
            trees = {"old": old, "new": ROOT}
            for k in range(args.rounds):
                order = ("old", "new") if k % 2 == 0 else ("new", "old")
                for which in order:
                    print(f"== round {k + 1}/{args.rounds}: {which} tree", flush=True)
                    output = Path(tmp) / f"{which}-{k}.json"
                    per_tree[which].append(
                        ratios(run_once(trees[which], args.script, args.args, output, args.result))
                    )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                check=False,
                capture_output=True,
            )
    keys = sorted(set().union(*per_tree["old"], *per_tree["new"]))
    medians = {
        which: {key: statistics.median(r[key] for r in runs if key in r) for key in keys}
        for which, runs in per_tree.items()
    }
    print(f"{'ratio':32}{'old':>10}{'new':>10}{'new/old':>10}")
    for key in keys:
        o, n = medians["old"][key], medians["new"][key]
        print(f"{key:32}{o:10.3f}{n:10.3f}{n / o:10.3f}")
    stem = Path(args.script).stem
    write_results(
        f"tree_vs_tree {stem}",
        f"tree_vs_tree_{stem}.json",
        {
            "old": args.old,
            "new": subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip(),
            "benchmark_args": args.args,
            "rounds": args.rounds,
            "medians": medians,
            "new_over_old": {k: medians["new"][k] / medians["old"][k] for k in keys},
            "every_round": per_tree,
            "wall_seconds": time.perf_counter() - started,
        },
    )


if __name__ == "__main__":
    main()
