"""The compiled DP step against lamina eager and torch DDP (eager and compiled), in one run.

Two gloo ranks, one thread each, interleaved rounds (the order rotates every round),
medians of the slowest rank. Workloads:

- ``narrow``: 24 blocks of width 128 (Linear, LayerNorm, GELU), batch 32, MSE: per-op
  overhead dominates, the regime a whole-step graph (and CUDA graphs on a GPU) targets;
- ``gpt``: the examples' GPT of ``_interleaved.py`` (GEMM-bound on the CPU).

Variants, each with a stock AdamW (lr 1e-4):

- ``eager``: ``lamina.distribute(model, "dp")``, the eager step;
- ``step``: ``lamina.compile_step`` on it (Inductor's C++ code): forward, loss, backward,
  the plan's all-reduces and AdamW's update in one graph;
- ``ddp``: torch ``DistributedDataParallel``, eager;
- ``ddp_compiled``: ``torch.compile(model)`` under DDP (its DDPOptimizer splits the graph
  at the buckets), AdamW eager.

The first step of each compiled variant (capture and compile, cold cache unless the
compiler's cache holds it) is reported apart, as ``first_step_s``. Writes
``results/compiled_step.json``::

    python benchmarks/compiled_step.py              # re-launches itself under torchrun
    python benchmarks/compiled_step.py --only narrow --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from _interleaved import add_ratios, relaunch_under_torchrun, report, workloads

VARIANTS = ("eager", "step", "ddp", "ddp_compiled")
PAIRS = (("step", "eager"), ("step", "ddp"), ("step", "ddp_compiled"), ("ddp_compiled", "ddp"))
#: One training step on a batch: the loss.
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def narrow() -> nn.Module:
    """24 blocks of width 128: Linear, LayerNorm, GELU."""
    blocks: list[nn.Module] = []
    for _ in range(24):
        blocks += [nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU()]
    return nn.Sequential(*blocks)


def _workloads(rank: int) -> dict[str, tuple[Any, Any, Any]]:
    def narrow_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 97 + rank)
        return torch.randn(32, 128, generator=gen), torch.randn(32, 128, generator=gen)

    return {"narrow": (narrow, narrow_batch, F.mse_loss), "gpt": workloads(rank)["gpt"]}


def _stepper(variant: str, model: nn.Module, loss_fn: Any) -> Step:
    """``variant``'s training step of ``model`` (built on this rank, rank 0's seed)."""
    if variant in ("eager", "step"):
        wrapped = lamina.distribute(model, "dp")
    elif variant == "ddp":
        wrapped = DDP(model)
    else:
        wrapped = torch.compile(DDP(model))  # type: ignore[assignment]
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    if variant == "step":
        return lamina.compile_step(wrapped, opt, loss_fn)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(wrapped(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every workload under every variant, interleaved (see the module docstring)."""
    torch.set_num_threads(1)
    runtime = lamina.init()
    results: dict[str, dict[str, Any]] = {}
    for name, (build, make_batch, loss_fn) in _workloads(runtime.rank).items():
        if args.only and name not in args.only:
            continue
        steps: dict[str, Step] = {}
        first: dict[str, float] = {}
        for variant in VARIANTS:
            torch.manual_seed(0)
            steps[variant] = _stepper(variant, build(), loss_fn)
            x, y = make_batch(0)
            dist.barrier()
            start = time.perf_counter()
            steps[variant](x, y)  # capture and compile, outside the timing
            first[variant] = time.perf_counter() - start
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        peaks = dict.fromkeys(VARIANTS, 0)
        step = 1
        for round_ in range(args.rounds + 1):  # round 0 warms up
            k = round_ % len(VARIANTS)
            for variant in [*VARIANTS[k:], *VARIANTS[:k]]:
                dist.barrier()
                runtime.handle.reset_peak_memory()
                for _ in range(args.steps):
                    x, y = make_batch(step)
                    step += 1
                    start = time.perf_counter()
                    steps[variant](x, y)
                    if round_ > 0:
                        times[variant].append(time.perf_counter() - start)
                peaks[variant] = max(peaks[variant], runtime.handle.memory_stats().peak or 0)
            if runtime.is_main:
                print(f"  {name}: round {round_}/{args.rounds} done", flush=True)
        medians = {v: statistics.median(times[v]) for v in VARIANTS}
        gathered: list[Any] = [None] * runtime.world_size
        dist.all_gather_object(gathered, (medians, peaks, first))
        results[name] = {
            "median_step_s": {v: max(g[0][v] for g in gathered) for v in VARIANTS},
            "peak_rss_bytes": {v: max(g[1][v] for g in gathered) for v in VARIANTS},
            "first_step_s": {v: max(g[2][v] for g in gathered) for v in VARIANTS},
            "steps_timed_per_variant": len(times[VARIANTS[0]]),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=6, help="steps per variant per round")
    parser.add_argument("--only", nargs="*", choices=("narrow", "gpt"), default=["narrow", "gpt"])
    parser.add_argument("--output", default="compiled_step.json", help="file in results/")
    args = parser.parse_args()
    relaunch_under_torchrun(__file__, nproc=2, argv=sys.argv[1:])
    results = run(args)
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        add_ratios(results, PAIRS)
        report("compiled_step", results, VARIANTS, PAIRS, args)
        for name, r in results.items():
            firsts = ", ".join(f"{v} {s:.1f} s" for v, s in r["first_step_s"].items())
            print(f"{name}: first step (capture, compile) {firsts}")
    lamina.shutdown()


if __name__ == "__main__":
    main()
