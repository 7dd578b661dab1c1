"""Shared machinery of the strategy benchmarks: workloads, interleaved timing, reports.

Both benchmarks compare three variants of the same training step on the same ranks:
each round runs a block of steps of every variant in rotating order (round 0 warms up),
so that slow phases of a shared machine hit every variant alike; medians of the slowest
rank are compared as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lamina
from lamina.session import MeshSpec

# the benchmark's GPT is the one the examples train (examples/ is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig, lm_loss

RESULTS = Path(__file__).resolve().parent / "results"

Batch = tuple[torch.Tensor, torch.Tensor]
Workload = tuple[
    Callable[[], nn.Module], Callable[[int], Batch], Callable[[torch.Tensor, torch.Tensor], Any]
]
#: (variant name, model) -> wrapped model
Wrapper = Callable[[str, nn.Module], nn.Module]


def gpt() -> nn.Module:
    """The examples' GPT at the benchmarks' fixed size: 4 layers, d 256, 4 heads, vocab 8192."""
    return GPT(GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_layers=4, n_heads=4))


def mlp() -> nn.Module:
    """4 x Linear(1024, 1024) with ReLU between."""
    layers: list[nn.Module] = []
    for k in range(4):
        layers.append(nn.Linear(1024, 1024))
        if k < 3:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp512() -> nn.Module:
    """4 x Linear(512, 512) with ReLU between: 4 MiB of fp32 gradients, a small model
    whose biases (2 KiB each) are latency-bound if bucketed alone."""
    layers: list[nn.Module] = []
    for k in range(4):
        layers.append(nn.Linear(512, 512))
        if k < 3:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


#: Every workload :func:`workloads` offers; benchmarks run ``DEFAULT_WORKLOADS`` unless
#: given ``--only``.
WORKLOADS = ("mlp", "mlp512", "gpt")
DEFAULT_WORKLOADS = ("mlp", "gpt")


def workloads(rank: int) -> dict[str, Workload]:
    """MLP 4 x 1024 and 4 x 512 (batch 256, MSE) and GPT (batch 8, seq 128,
    cross-entropy); data differ by rank."""

    def mlp_batch(step: int) -> Batch:
        gen = torch.Generator().manual_seed(step * 97 + rank)
        return torch.randn(256, 1024, generator=gen), torch.randn(256, 1024, generator=gen)

    def mlp512_batch(step: int) -> Batch:
        gen = torch.Generator().manual_seed(step * 97 + rank)
        return torch.randn(256, 512, generator=gen), torch.randn(256, 512, generator=gen)

    def gpt_batch(step: int) -> Batch:
        gen = torch.Generator().manual_seed(step * 97 + rank)
        idx = torch.randint(0, 8192, (8, 129), generator=gen)
        return idx[:, :-1], idx[:, 1:]

    return {
        "mlp": (mlp, mlp_batch, F.mse_loss),
        "mlp512": (mlp512, mlp512_batch, F.mse_loss),
        "gpt": (gpt, gpt_batch, lm_loss),
    }


def base_parser(
    description: str, output: str, default_workloads: Sequence[str] = DEFAULT_WORKLOADS
) -> argparse.ArgumentParser:
    """Arguments every strategy benchmark takes (``--only`` defaults to
    ``default_workloads``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=6, help="steps per variant per round")
    parser.add_argument(
        "--only",
        nargs="*",
        choices=WORKLOADS,
        default=list(default_workloads),
        help=f"run these workloads (default: {' '.join(default_workloads)})",
    )
    parser.add_argument("--output", default=output, help="file name in benchmarks/results")
    return parser


def without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` less ``--nproc N`` / ``--nproc=N``: torchrun would take ``--nproc`` for its
    own ``--nproc-per-node`` (an abbreviation), and the ranks do not need it."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch_under_torchrun(
    script: str,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
) -> None:
    """Without a torchrun environment, run ``script`` again on ``nproc`` ranks (with
    ``env`` added to the environment, and ``argv``, default this process's arguments)
    and exit with its status."""
    if "RANK" in os.environ:
        return
    cmd = torchrun_command(script, nproc, sys.argv[1:] if argv is None else argv)
    sys.exit(subprocess.call(cmd, env={**os.environ, **(env or {})}))


def torchrun_command(script: str, nproc: int, argv: Sequence[str]) -> list[str]:
    """The command running ``script argv`` on ``nproc`` local ranks under torchrun."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        script,
        *argv,
    ]


def run_interleaved(
    args: argparse.Namespace,
    variants: Sequence[str],
    wrap: Wrapper,
    describe: Callable[[str, dict[str, nn.Module]], dict[str, Any]] | None = None,
    mesh: MeshSpec = "flat",
    backend: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Time every workload under every variant, interleaved; results from the slowest rank.

    ``mesh`` and ``backend`` are passed to :func:`lamina.init` (``"topology"``: ``inter``
    x ``intra``; ``backend`` None: ``$LAMINA_BACKEND``, else the best available). Models
    and batches live on the runtime's device; off the CPU every step is timed between
    two device synchronizations (peak memory is then the device's, not the RSS).
    """
    torch.set_num_threads(1)
    runtime = lamina.init(backend, mesh=mesh)
    device = runtime.device
    synchronize = runtime.handle.synchronize if device.type != "cpu" else _no_sync
    results: dict[str, dict[str, Any]] = {}
    for name, (build, make_batch, loss_fn) in workloads(runtime.rank).items():
        if args.only and name not in args.only:
            continue
        models: dict[str, nn.Module] = {}
        opts: dict[str, torch.optim.Optimizer] = {}
        for variant in variants:
            torch.manual_seed(0)
            models[variant] = wrap(variant, build().to(device))
            opts[variant] = torch.optim.AdamW(models[variant].parameters(), lr=1e-4)
        times: dict[str, list[float]] = {v: [] for v in variants}
        peaks = dict.fromkeys(variants, 0)
        step = 0
        for round_ in range(args.rounds + 1):  # round 0 warms up (capture, allocations)
            k = round_ % len(variants)
            for variant in [*variants[k:], *variants[:k]]:
                model, opt = models[variant], opts[variant]
                dist.barrier()
                runtime.handle.reset_peak_memory()
                for _ in range(args.steps):
                    x, y = (t.to(device) for t in make_batch(step))
                    step += 1
                    synchronize()
                    start = time.perf_counter()
                    loss_fn(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    synchronize()
                    if round_ > 0:
                        times[variant].append(time.perf_counter() - start)
                peaks[variant] = max(peaks[variant], runtime.handle.memory_stats().peak or 0)
            if runtime.is_main:
                print(f"  {name}: round {round_}/{args.rounds} done", flush=True)
        medians = {v: statistics.median(times[v]) for v in variants}
        gathered: list[Any] = [None] * runtime.world_size
        dist.all_gather_object(gathered, (medians, peaks))
        results[name] = {
            "median_step_s": {v: max(g[0][v] for g in gathered) for v in variants},
            "peak_rss_bytes": {v: max(g[1][v] for g in gathered) for v in variants},
            "steps_timed_per_variant": len(times[variants[0]]),
            **(describe(name, models) if describe else {}),
        }
    return results


def _no_sync() -> None:
    """On the CPU a step's work is done when its Python returns."""


def add_ratios(results: dict[str, dict[str, Any]], pairs: Sequence[tuple[str, str]]) -> None:
    """Add ``"a_over_b"`` time ratios (and peak-RSS ratios) for each (a, b)."""
    for r in results.values():
        t, p = r["median_step_s"], r["peak_rss_bytes"]
        for a, b in pairs:
            r[f"{a}_over_{b}"] = t[a] / t[b]
            r[f"{a}_over_{b}_peak_rss"] = p[a] / p[b] if p[b] else None


def report(
    benchmark: str,
    results: dict[str, dict[str, Any]],
    variants: Sequence[str],
    pairs: Sequence[tuple[str, str]],
    args: argparse.Namespace,
    extra: dict[str, Any] | None = None,
) -> None:
    """Print the table and write the JSON file."""
    cols = [f"{v} ms" for v in variants] + [f"{a}/{b}" for a, b in pairs]
    print(f"{'workload':9}" + "".join(f"{c:>13}" for c in cols) + "   peak RSS MiB")
    for name, r in results.items():
        t, p = r["median_step_s"], r["peak_rss_bytes"]
        cells = [f"{t[v] * 1e3:13.1f}" for v in variants]
        cells += [f"{r[f'{a}_over_{b}']:13.3f}" for a, b in pairs]
        peaks = "/".join(f"{p[v] / 2**20:.0f}" for v in variants)
        print(f"{name:9}" + "".join(cells) + f"   {peaks}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / args.output
    payload = {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "world_size": dist.get_world_size(),
        "threads_per_rank": 1,
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "variants": list(variants),
        **(extra or {}),
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")
