"""A pipelined step with its stages' blocks compiled (``lamina.compile_step`` on ``pp``)
against the eager pipelined step, per schedule, in one run.

Two gloo ranks (one stage each; ``zbv``: two each), one thread each, the benchmarks'
GPT (``_interleaved.gpt``: 4 blocks, d 256, vocab 8192; batch 8 of 128 tokens, 4
microbatches), AdamW, every step clipping at ``--max-norm`` (default 1.0): the eager
variant runs ``model.step``, ``model.clip_grad_norm_`` and the optimizer; the compiled
one ``step(x, y)`` (Inductor). Both models are cut at the same block. Rounds are
interleaved (the order alternates every round; round 0 compiles and warms up), medians
of the slowest rank. The compiled variant's first step (captures and compiles, cold:
a fresh Inductor cache) is reported apart. Writes ``results/compiled_pipeline.json``::

    python benchmarks/compiled_pipeline.py                  # re-launches itself under torchrun
    python benchmarks/compiled_pipeline.py --schedules 1f1b --rounds 3
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import lamina
from _interleaved import gpt, relaunch_under_torchrun, workloads
from _results import write_results

VARIANTS = ("eager", "compiled")


def _variant(name: str, schedule: str, example: torch.Tensor, max_norm: float) -> Any:
    """``name``'s step function on a freshly distributed GPT."""
    torch.manual_seed(0)
    model = lamina.distribute(
        gpt(),
        "pp",
        example_inputs=(example,),
        schedule=schedule,
        microbatches=4,
        timing_runs=1,
        split_points=["blocks.1", "blocks.2", "blocks.3"] if schedule == "zbv" else ["blocks.2"],
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = workloads(0)["gpt"][2]
    if name == "compiled":
        return lamina.compile_step(model, optimizer, loss_fn, max_norm=max_norm)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss: torch.Tensor = model.step(x, y, loss_fn)  # type: ignore[operator]
        model.clip_grad_norm_(max_norm)  # type: ignore[operator]
        optimizer.step()
        return loss

    return step


def measure(args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    runtime = lamina.current()
    assert runtime is not None
    make_batch = workloads(runtime.rank)["gpt"][1]
    example, _ = make_batch(0)
    steps = {v: _variant(v, schedule, example, args.max_norm) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    first: dict[str, float] = {}
    counter = 0
    for round_ in range(args.rounds + 1):
        order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            for k in range(args.steps):
                x, y = make_batch(counter)
                counter += 1
                dist.barrier()
                started = time.perf_counter()
                steps[variant](x, y)
                seconds = time.perf_counter() - started
                if round_ == 0 and k == 0:
                    first[variant] = seconds
                elif round_ > 0:
                    times[variant].append(seconds)
        if runtime.is_main:
            print(f"  {schedule}: round {round_}/{args.rounds} done", flush=True)
    medians = {v: statistics.median(times[v]) for v in VARIANTS}
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, (medians, first))
    compiled = steps["compiled"]
    slowest = {v: max(g[0][v] for g in gathered) for v in VARIANTS}
    return {
        "median_step_s": slowest,
        "first_step_s": {v: max(g[1][v] for g in gathered) for v in VARIANTS},
        "compiled_over_eager": slowest["compiled"] / slowest["eager"],
        "eager_reason": compiled.eager_reason,
        "graphs": compiled.backend.graphs,
        "steps_timed_per_variant": len(times["eager"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--schedules", nargs="*", default=["1f1b", "zbv"])
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip to this total norm")
    parser.add_argument("--output", default="compiled_pipeline.json", help="file in results/")
    args = parser.parse_args()
    if "LAMINA_BENCH_CACHE" not in os.environ:  # cold: a fresh Inductor cache
        cache = tempfile.mkdtemp(prefix="lamina-compiled-pipeline-cache-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["LAMINA_BENCH_CACHE"] = cache
        os.environ["LAMINA_COMPILE_CACHE"] = ""
    relaunch_under_torchrun(__file__, nproc=2)
    torch.set_num_threads(1)
    runtime = lamina.init(mesh={"pp": 2})
    results = {schedule: measure(args, schedule) for schedule in args.schedules}
    if runtime.is_main:
        print(f"{'schedule':10}{'eager ms':>10}{'compiled ms':>13}{'ratio':>8}{'first s':>9}")
        for schedule, r in results.items():
            t = r["median_step_s"]
            print(
                f"{schedule:10}{t['eager'] * 1e3:10.1f}{t['compiled'] * 1e3:13.1f}"
                f"{r['compiled_over_eager']:8.3f}{r['first_step_s']['compiled']:9.1f}"
                f"  {r['eager_reason'] or 'compiled'}"
            )
        write_results(
            "compiled_pipeline",
            args.output,
            {
                "world_size": runtime.world_size,
                "max_norm": args.max_norm,
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "results": results,
            },
        )
    lamina.shutdown()


if __name__ == "__main__":
    main()
