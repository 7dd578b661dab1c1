"""lamina DP vs torch DDP vs the compute-only limit, interleaved in one run.

Two gloo ranks, one thread each, two fixed workloads (MLP: 4 x Linear(1024, 1024),
batch 256, MSE; GPT: 4 layers, d_model 256, 4 heads, vocab 8192, seq 128, batch 8,
cross-entropy), AdamW. Each round runs a block of steps of every variant in rotating
order; the table reports median step times, the ratios lamina/DDP and lamina/limit, and
the peak RSS each variant reached. Run it as::

    python benchmarks/dp_vs_ddp.py            # re-launches itself under torchrun, 2 ranks
    lamina run --nproc-per-node 2 benchmarks/dp_vs_ddp.py
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
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina

# the benchmark's GPT is the one the examples train (examples/ is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig, lm_loss

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("lamina", "ddp", "limit")


def gpt() -> nn.Module:
    """The examples' GPT at the benchmark's fixed size."""
    return GPT(GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_layers=4, n_heads=4))


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for k in range(4):
        layers.append(nn.Linear(1024, 1024))
        if k < 3:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


Workload = tuple[
    Callable[[], nn.Module],
    Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
]


def workloads(rank: int) -> dict[str, Workload]:
    def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 97 + rank)
        return torch.randn(256, 1024, generator=gen), torch.randn(256, 1024, generator=gen)

    def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 97 + rank)
        idx = torch.randint(0, 8192, (8, 129), generator=gen)
        return idx[:, :-1], idx[:, 1:]

    return {"mlp": (mlp, mlp_batch, F.mse_loss), "gpt": (gpt, gpt_batch, lm_loss)}


def wrap(variant: str, model: nn.Module, bucket_cap_mb: float | None) -> nn.Module:
    if variant == "lamina":
        return lamina.distribute(model, "dp", bucket_cap_mb=bucket_cap_mb)
    if variant == "ddp":
        return DDP(model)
    return model  # the limit: the same compute, no gradient synchronization


def run_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    runtime = lamina.init()
    results: dict[str, dict[str, object]] = {}
    for name, (build, make_batch, loss_fn) in workloads(runtime.rank).items():
        if args.only and name not in args.only:
            continue
        models, opts = {}, {}
        for variant in VARIANTS:
            torch.manual_seed(0)
            models[variant] = wrap(variant, build(), args.bucket_cap_mb)
            opts[variant] = torch.optim.AdamW(models[variant].parameters(), lr=1e-4)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        peaks: dict[str, int] = {v: 0 for v in VARIANTS}
        step = 0
        for round_ in range(args.rounds + 1):  # round 0 warms up (capture, allocations)
            order = VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]
            for variant in order:
                model, opt = models[variant], opts[variant]
                dist.barrier()
                runtime.handle.reset_peak_memory()
                for _ in range(args.steps):
                    x, y = make_batch(step)
                    step += 1
                    start = time.perf_counter()
                    loss_fn(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    elapsed = time.perf_counter() - start
                    if round_ > 0:
                        times[variant].append(elapsed)
                peak = runtime.handle.memory_stats().peak or 0
                peaks[variant] = max(peaks[variant], peak)
            if runtime.is_main:
                print(f"  {name}: round {round_}/{args.rounds} done", flush=True)
        medians = {v: statistics.median(times[v]) for v in VARIANTS}
        # every rank's median; a step is as slow as its slowest rank
        gathered: list[dict[str, float] | None] = [None] * runtime.world_size
        dist.all_gather_object(gathered, medians)
        slowest = {v: max(g[v] for g in gathered if g) for v in VARIANTS}
        peak_list: list[dict[str, int] | None] = [None] * runtime.world_size
        dist.all_gather_object(peak_list, peaks)
        results[name] = {
            "median_step_s": slowest,
            "lamina_over_ddp": slowest["lamina"] / slowest["ddp"],
            "lamina_over_limit": slowest["lamina"] / slowest["limit"],
            "ddp_over_limit": slowest["ddp"] / slowest["limit"],
            "peak_rss_bytes": {v: max(p[v] for p in peak_list if p) for v in VARIANTS},
            "steps_timed_per_variant": len(times["lamina"]),
            "lamina_buckets": len(models["lamina"].plan.buckets),  # type: ignore[union-attr]
        }
    if runtime.is_main:
        report(results, args, runtime.world_size)
    lamina.shutdown()


def report(results: dict[str, dict[str, object]], args: argparse.Namespace, world: int) -> None:
    header = (
        f"{'workload':8} {'lamina ms':>10} {'ddp ms':>8} {'limit ms':>9} "
        f"{'lamina/ddp':>10} {'lamina/limit':>12} {'ddp/limit':>9}  peak RSS MiB (l/d/x)"
    )
    print(header)
    for name, r in results.items():
        t = r["median_step_s"]
        p = r["peak_rss_bytes"]
        assert isinstance(t, dict) and isinstance(p, dict)
        print(
            f"{name:8} {t['lamina'] * 1e3:10.1f} {t['ddp'] * 1e3:8.1f} {t['limit'] * 1e3:9.1f} "
            f"{r['lamina_over_ddp']:10.3f} {r['lamina_over_limit']:12.3f} "
            f"{r['ddp_over_limit']:9.3f}  " + "/".join(f"{p[v] / 2**20:.0f}" for v in VARIANTS)
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / args.output
    payload = {
        "benchmark": "dp_vs_ddp",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "world_size": world,
        "threads_per_rank": 1,
        "rounds": args.rounds,
        "lamina_bucket_cap_mb": args.bucket_cap_mb,
        "steps_per_block": args.steps,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=6, help="steps per variant per round")
    parser.add_argument("--only", nargs="*", choices=["mlp", "gpt"], help="run these workloads")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="lamina's bucket cap (default: auto)"
    )
    parser.add_argument("--output", default="dp_vs_ddp.json", help="file in benchmarks/results")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # re-launch under torchrun with 2 ranks
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            *sys.argv[1:],
        ]
        sys.exit(subprocess.call(cmd))
    run_worker(args)


if __name__ == "__main__":
    main()
