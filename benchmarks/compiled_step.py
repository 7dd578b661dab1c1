"""The compiled step (dp and zero3) against lamina eager, torch DDP and FSDP2, eager and
compiled, in one run.

Two gloo ranks, one thread each, interleaved rounds (the order rotates every round),
medians of the slowest rank. Workloads:

- ``narrow``: 24 blocks of width 128 (Linear, LayerNorm, GELU), batch 32, MSE: per-op
  overhead dominates, the regime a whole-step graph (and CUDA graphs on a GPU) targets;
- ``gpt``: the examples' GPT of ``_interleaved.py`` (GEMM-bound on the CPU).

Variants, each with a stock AdamW (lr 1e-4):

- ``eager``: ``lamina.distribute(model, "dp")``, the eager step;
- ``step``: ``lamina.compile_step`` on it (Inductor's C++ code): forward, loss, backward,
  the plan's all-reduces and AdamW's update in one graph;
- ``step_overlap``: the same with ``overlap=True`` (Inductor issues each all-reduce as
  soon as its bucket's last gradient is computed, and waits as late as it can);
- ``ddp``: torch ``DistributedDataParallel``, eager;
- ``ddp_compiled``: ``torch.compile(model)`` under DDP (its DDPOptimizer splits the graph
  at the buckets), AdamW eager;
- ``ddp_ca``: ``torch.compile(model)`` under DDP with compiled autograd and DDP's python
  reducer (``optimize_ddp="python_reducer"``): the backward and its all-reduces traced;
- ``zero3``: ``lamina.distribute(model, "zero3")``, the eager step;
- ``zero3_step``: ``lamina.compile_step`` on it (gathers, reduce-scatters, AdamW);
- ``fsdp2``: torch FSDP2 (``fully_shard`` per block and the root), eager;
- ``fsdp2_compiled``: the same with ``torch.compile`` per block (each block compiled,
  then sharded, as torchtitan does), AdamW eager.

Compile time is reported apart from step time: ``first_step_s`` is each variant's first
step (capture and compile; lamina's ZeRO-3 step runs its first step eagerly and compiles
at its second, which is the one reported) with the compiler's cache cold (a fresh
``TORCHINDUCTOR_CACHE_DIR`` for the run, unless ``--keep-cache``), and
``warm_first_step_s`` the first step of a second, identical ``step`` / ``zero3_step``
built afterwards in the same run, as a second run of a script finds the cache (variants
compiled later in a run find the C++ kernels the earlier ones built: their "cold" figure
is partly warm). Peak RSS (``peak_rss_bytes``) is the process's high-water mark over a
variant's steps, reset before them; every variant lives in the one process, so
``peak_rss_rise_bytes`` (that mark above the resident set at the reset) is what the
variant's step itself adds.
Writes ``results/compiled_step.json``::

    python benchmarks/compiled_step.py              # re-launches itself under torchrun
    python benchmarks/compiled_step.py --only narrow --rounds 3
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo import compiled_autograd
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from _interleaved import add_ratios, relaunch_under_torchrun, report, workloads

VARIANTS = (
    "eager",
    "step",
    "step_overlap",
    "ddp",
    "ddp_compiled",
    "ddp_ca",
    "zero3",
    "zero3_step",
    "fsdp2",
    "fsdp2_compiled",
)
PAIRS = (
    ("step", "eager"),
    ("step_overlap", "step"),
    ("step", "ddp"),
    ("step", "ddp_compiled"),
    ("step", "ddp_ca"),
    ("zero3_step", "zero3"),
    ("zero3_step", "fsdp2_compiled"),
    ("fsdp2_compiled", "fsdp2"),
)
#: The lamina variants whose compile is timed again with the cache warm.
LAMINA_COMPILED = ("step", "zero3_step")
#: The compiled lamina variants and their compile_step options.
STEP_OPTIONS: dict[str, dict[str, Any]] = {
    "step": {},
    "step_overlap": {"overlap": True},
    "zero3_step": {},
}
#: One training step on a batch: the loss.
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def narrow() -> nn.Module:
    """24 blocks of width 128: Linear, LayerNorm, GELU."""
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU()) for _ in range(24))
    )


def _block_list(model: nn.Module) -> nn.Sequential | nn.ModuleList:
    """The container of the repeated blocks: the narrow model itself, the GPT's
    ``blocks``."""
    for child in model.children():
        if isinstance(child, nn.ModuleList):
            return child
    assert isinstance(model, nn.Sequential)
    return model


def _workloads(rank: int) -> dict[str, tuple[Any, Any, Any]]:
    def narrow_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 97 + rank)
        return torch.randn(32, 128, generator=gen), torch.randn(32, 128, generator=gen)

    return {"narrow": (narrow, narrow_batch, F.mse_loss), "gpt": workloads(rank)["gpt"]}


def _wrapped(variant: str, model: nn.Module) -> nn.Module:
    """``model`` distributed as ``variant`` distributes it."""
    if variant in ("eager", "step", "step_overlap"):
        return lamina.distribute(model, "dp")
    if variant in ("zero3", "zero3_step"):
        return lamina.distribute(model, "zero3")
    if variant == "ddp":
        return DDP(model)
    if variant == "ddp_compiled":
        return torch.compile(DDP(model))  # type: ignore[return-value]
    if variant == "ddp_ca":  # DDP reads the mode as it is built
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
            return torch.compile(DDP(model))  # type: ignore[return-value]
    blocks = _block_list(model)  # fsdp2(_compiled), as torchtitan: compile, then shard
    for i, block in enumerate(list(blocks.children())):
        if variant == "fsdp2":
            fully_shard(block)
            continue
        compiled = torch.compile(block)  # its own module: FSDP2's hooks stay outside
        assert isinstance(compiled, nn.Module)
        fully_shard(compiled)
        blocks[i] = compiled
    fully_shard(model)
    return model


def _stepper(variant: str, model: nn.Module, loss_fn: Any) -> Step:
    """``variant``'s training step of ``model`` (built on this rank, rank 0's seed)."""
    wrapped = _wrapped(variant, model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    if variant in STEP_OPTIONS:
        return lamina.compile_step(wrapped, opt, loss_fn, **STEP_OPTIONS[variant])

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(wrapped(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if variant != "ddp_ca":
        return step

    def compiled_autograd_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with (
            torch._dynamo.config.patch(optimize_ddp="python_reducer"),
            compiled_autograd._enable(torch.compile),
        ):
            return step(x, y)

    return compiled_autograd_step


def _first_compile(variant: str, step: Step, batch: Any) -> float:
    """Seconds of ``variant``'s step that captures and compiles (see the docstring)."""
    x, y = batch
    if variant == "zero3_step":
        step(x, y)  # eager: records the units' order
    dist.barrier()
    start = time.perf_counter()
    step(x, y)
    return time.perf_counter() - start


def chosen(args: argparse.Namespace) -> tuple[str, ...]:
    """The variants ``--variants`` names, in :data:`VARIANTS` order."""
    return tuple(v for v in VARIANTS if v in args.variants)


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every workload under every variant, interleaved (see the module docstring)."""
    torch.set_num_threads(1)
    variants = chosen(args)
    runtime = lamina.init()
    results: dict[str, dict[str, Any]] = {}
    for name, (build, make_batch, loss_fn) in _workloads(runtime.rank).items():
        if args.only and name not in args.only:
            continue
        steps: dict[str, Step] = {}
        first: dict[str, float] = {}
        for variant in variants:
            torch.manual_seed(0)
            steps[variant] = _stepper(variant, build(), loss_fn)
            first[variant] = _first_compile(variant, steps[variant], make_batch(0))
            if runtime.is_main:
                print(f"  {name}: {variant} first step {first[variant]:.1f} s", flush=True)
        warm: dict[str, float] = {}
        for variant in (
            v for v in LAMINA_COMPILED if v in variants
        ):  # a second, identical one: the cache is warm
            torch.manual_seed(0)
            again = _stepper(variant, build(), loss_fn)
            warm[variant] = _first_compile(variant, again, make_batch(0))
        times: dict[str, list[float]] = {v: [] for v in variants}
        peaks = dict.fromkeys(variants, 0)
        rises = dict.fromkeys(variants, 0)
        step = 1
        for round_ in range(args.rounds + 1):  # round 0 warms up
            k = round_ % len(variants)
            for variant in [*variants[k:], *variants[:k]]:
                dist.barrier()
                runtime.handle.reset_peak_memory()
                before = runtime.handle.memory_stats().allocated or 0
                for _ in range(args.steps):
                    x, y = make_batch(step)
                    step += 1
                    start = time.perf_counter()
                    steps[variant](x, y)
                    if round_ > 0:
                        times[variant].append(time.perf_counter() - start)
                peak = runtime.handle.memory_stats().peak or 0
                peaks[variant] = max(peaks[variant], peak)
                rises[variant] = max(rises[variant], peak - before)
            if runtime.is_main:
                print(f"  {name}: round {round_}/{args.rounds} done", flush=True)
        medians = {v: statistics.median(times[v]) for v in variants}
        gathered: list[Any] = [None] * runtime.world_size
        dist.all_gather_object(gathered, (medians, peaks, first, warm, rises))
        results[name] = {
            "median_step_s": {v: max(g[0][v] for g in gathered) for v in variants},
            "peak_rss_bytes": {v: max(g[1][v] for g in gathered) for v in variants},
            "first_step_s": {v: max(g[2][v] for g in gathered) for v in variants},
            "warm_first_step_s": {v: max(g[3][v] for g in gathered) for v in warm},
            "peak_rss_rise_bytes": {v: max(g[4][v] for g in gathered) for v in variants},
            "steps_timed_per_variant": len(times[variants[0]]),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=6, help="steps per variant per round")
    parser.add_argument("--only", nargs="*", choices=("narrow", "gpt"), default=["narrow", "gpt"])
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--output", default="compiled_step.json", help="file in results/")
    parser.add_argument(
        "--keep-cache", action="store_true", help="use the compiler's cache as it is (warm)"
    )
    args = parser.parse_args()
    if not args.keep_cache and "LAMINA_BENCH_CACHE" not in os.environ:  # cold: a fresh one
        cache = tempfile.mkdtemp(prefix="lamina-compiled-step-cache-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["LAMINA_BENCH_CACHE"] = cache
    relaunch_under_torchrun(__file__, nproc=2, argv=sys.argv[1:])
    results = run(args)
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        variants = chosen(args)
        pairs = [(a, b) for a, b in PAIRS if a in variants and b in variants]
        add_ratios(results, pairs)
        report("compiled_step", results, variants, pairs, args)
        for name, r in results.items():
            firsts = ", ".join(f"{v} {s:.1f} s" for v, s in r["first_step_s"].items())
            warms = ", ".join(f"{v} {s:.1f} s" for v, s in r["warm_first_step_s"].items())
            print(f"{name}: first step (capture, compile; cache cold) {firsts}")
            print(f"{name}: first step again (cache warm) {warms}")
            rises = ", ".join(f"{v} {b / 2**20:.1f}" for v, b in r["peak_rss_rise_bytes"].items())
            print(f"{name}: peak RSS rise over its steps, MiB: {rises}")
    lamina.shutdown()


if __name__ == "__main__":
    main()
