"""Compile once per job: the compiled step's first step on 2 ranks, every rank compiling
(``LAMINA_COMPILE_ONCE=0``, as before) against one rank compiling and the other loading
its artifacts, then a second run of the same script.

The GPT of the benchmarks (``_interleaved.gpt``: 4 layers, d 256, vocab 8192, batch 8 x
128), AdamW, ``lamina.compile_step`` with Inductor, under ``dp`` and ``zero3`` (whose first
call runs eagerly: the step timed is the one that compiles). Each run is a fresh
``torchrun`` job of 2 ranks, one thread each; runs, per strategy:

- ``every_rank_cold``: ``LAMINA_COMPILE_ONCE=0``, a fresh Inductor cache;
- ``every_rank_second``: the same again (torch's own caches warm, no lamina file);
- ``once_cold``: one rank compiles, a fresh Inductor cache and a fresh lamina cache dir;
- ``once_second``: the same again (both caches warm): a second run of the same script;
- ``once_file_only``: a fresh Inductor cache, lamina's cache file kept (another machine,
  or ``/tmp`` cleared): the file holds the graphs, not Inductor's C++ kernels, which are
  compiled again.

Reported per run: ``first_step_s`` (slowest rank, the compiling step only),
``to_first_step_end_s`` (the slowest rank's seconds from the script's start, torch's
import included, to that step's end), how each rank got its graph and the summary line.
Writes ``results/compile_once.json``::

    python benchmarks/compile_once.py                 # both strategies, every run
    python benchmarks/compile_once.py --strategies dp --repeat 2
"""

# ruff: noqa: E402  (the clock starts before torch's import)
from __future__ import annotations

import time

STARTED = time.perf_counter()  # before torch's import: a script's whole wait

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lamina
from _interleaved import torchrun_command, workloads
from _results import write_results

RUNS = ("every_rank_cold", "every_rank_second", "once_cold", "once_second", "once_file_only")
#: Where a rank-mode run writes its result (set by the driver).
ENV_OUT = "LAMINA_BENCH_COMPILE_ONCE_OUT"
STEPS_AFTER = 2


def rank_main(strategy: str) -> None:
    """One job: build, compile, time the compiling step; rank 0 writes the result."""
    torch.set_num_threads(1)
    runtime = lamina.init()
    build, make_batch, loss_fn = workloads(runtime.rank)["gpt"]
    torch.manual_seed(0)
    model = lamina.distribute(build(), strategy)
    step = lamina.compile_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn)
    losses = []
    if strategy == "zero3":
        losses.append(float(step(*make_batch(0))))  # eager: records the units' order
    dist.barrier()
    start = time.perf_counter()
    losses.append(float(step(*make_batch(len(losses)))))
    end = time.perf_counter()
    first, since_start = end - start, end - STARTED
    for _ in range(STEPS_AFTER):
        losses.append(float(step(*make_batch(len(losses)))))
    (outcome,) = step.checked.once.outcomes
    mine = {
        "first_step_s": first,
        "to_first_step_end_s": since_start,
        "how": outcome.how,
        "inductor_compiles": outcome.inductor_compiles,
        "backend_s": outcome.seconds,
        "losses": losses,
        "summary": model.step_summary(),
    }
    ranks: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(ranks, mine)
    if runtime.is_main:
        result = {
            "first_step_s": max(r["first_step_s"] for r in ranks),
            "to_first_step_end_s": max(r["to_first_step_end_s"] for r in ranks),
            "line": outcome.describe(),
            "ranks": ranks,
        }
        Path(os.environ[ENV_OUT]).write_text(json.dumps(result))
    lamina.shutdown()


def _job(strategy: str, env: dict[str, str]) -> dict[str, Any]:
    """One torchrun job of 2 ranks with ``env`` added; rank 0's result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = Path(out.name)
    cmd = torchrun_command(__file__, 2, ["--rank-mode", strategy])
    subprocess.run(cmd, env={**os.environ, **env, ENV_OUT: str(path)}, check=True)
    result: dict[str, Any] = json.loads(path.read_text())
    result["load_average_1min_after"] = os.getloadavg()[0]  # others' jobs on the machine
    path.unlink()
    return result


def _runs(strategy: str, scratch: Path) -> dict[str, dict[str, Any]]:
    """Every run of :data:`RUNS` for ``strategy``, in order, with fresh caches."""

    def dirs(name: str) -> tuple[Path, Path]:
        inductor, own = scratch / f"{strategy}-{name}-inductor", scratch / f"{strategy}-lamina"
        return inductor, own

    every, _ = dirs("every")
    once, own = dirs("once")
    fresh, _ = dirs("fresh")
    for folder in (every, once, own, fresh):
        shutil.rmtree(folder, ignore_errors=True)
    off = {"LAMINA_COMPILE_ONCE": "0", "LAMINA_COMPILE_CACHE": ""}
    on = {"LAMINA_COMPILE_ONCE": "1", "LAMINA_COMPILE_CACHE": str(own)}
    plan = {
        "every_rank_cold": {**off, "TORCHINDUCTOR_CACHE_DIR": str(every)},
        "every_rank_second": {**off, "TORCHINDUCTOR_CACHE_DIR": str(every)},
        "once_cold": {**on, "TORCHINDUCTOR_CACHE_DIR": str(once)},
        "once_second": {**on, "TORCHINDUCTOR_CACHE_DIR": str(once)},
        "once_file_only": {**on, "TORCHINDUCTOR_CACHE_DIR": str(fresh)},
    }
    results = {}
    for run, env in plan.items():
        results[run] = _job(strategy, env)
        r = results[run]
        print(f"  {strategy} {run}: first step {r['first_step_s']:.1f} s ({r['line']})", flush=True)
    return results


def summarize(sittings: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Print the table; per strategy, the median and the least (the run least disturbed
    on a shared machine) of each run's first step over the sittings, and their ratios."""
    print(f"{'strategy':9}{'run':19}{'first step s':>16}{'to its end s':>14}   how")
    summary: dict[str, dict[str, Any]] = {}
    for strategy, runs in sittings.items():
        for run in RUNS:
            firsts = [r[run]["first_step_s"] for r in runs]
            ends = [r[run]["to_first_step_end_s"] for r in runs]
            shown = "/".join(f"{s:.1f}" for s in firsts)
            print(f"{strategy:9}{run:19}{shown:>16}{min(ends):14.1f}   {runs[-1][run]['line']}")
        median = {run: statistics.median(r[run]["first_step_s"] for r in runs) for run in RUNS}
        least = {run: min(r[run]["first_step_s"] for r in runs) for run in RUNS}
        ratios = {
            "median": median["once_cold"] / median["every_rank_cold"],
            "least": least["once_cold"] / least["every_rank_cold"],
        }
        print(
            f"{strategy:9}once_cold / every_rank_cold: {ratios['median']:.2f} (median), "
            f"{ratios['least']:.2f} (least)"
        )
        summary[strategy] = {
            "median_first_step_s": median,
            "least_first_step_s": least,
            "once_cold_over_every_rank_cold": ratios,
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="*", choices=("dp", "zero3"), default=["dp", "zero3"])
    parser.add_argument("--repeat", type=int, default=1, help="sittings of every run")
    parser.add_argument("--output", default="compile_once.json", help="file in results/")
    parser.add_argument("--rank-mode", choices=("dp", "zero3"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        rank_main(args.rank_mode)
        return
    scratch = Path(tempfile.mkdtemp(prefix="lamina-compile-once-"))
    try:
        sittings = {s: [_runs(s, scratch) for _ in range(args.repeat)] for s in args.strategies}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(sittings)
    write_results(
        "compile_once",
        args.output,
        {
            "world_size": 2,
            "threads_per_rank": 1,
            "model": "GPT 4 layers, d 256, vocab 8192, batch 8 x 128, AdamW, Inductor",
            "summary": summary,
            "sittings": sittings,
        },
    )


if __name__ == "__main__":
    main()
