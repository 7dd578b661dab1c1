"""Peak memory of lamina ZeRO-3 vs torch FSDP2, each variant alone in its own processes.

``zero3_vs_fsdp2.py`` keeps every variant's model resident in the same ranks, so its
peak-RSS column also measures what the other variants' freed memory left in the
allocator (run to run it moves by about 1.5%). Here each (workload, variant) is one
torchrun job of 2 gloo ranks that builds only that model: 3 warm-up steps, then the
resident-set high-water mark is reset and 5 more steps run. Reported per job, slowest
rank: the peak, and the peak above the resident set before the measured steps (the
transient memory of a step). Jobs alternate the variants and repeat ``--repeats`` times;
the table shows medians. Run it as::

    python benchmarks/zero3_peak_memory.py        # writes results/zero3_peak_memory.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lamina
from _interleaved import workloads
from _results import write_results
from zero3_vs_fsdp2 import fsdp2

VARIANTS = ("lamina", "fsdp2")
WARMUP_STEPS, MEASURED_STEPS = 3, 5


def _wrap(variant: str, model: nn.Module) -> nn.Module:
    if variant == "lamina":
        return lamina.distribute(model, "zero3", min_unit_numel=0)
    return fsdp2(model)


def measure(workload: str, variant: str, out: Path) -> None:
    """One rank of one job: train ``workload`` under ``variant``, write the peaks (rank 0)."""
    torch.set_num_threads(1)
    runtime = lamina.init()
    build, make_batch, loss_fn = workloads(runtime.rank)[workload]
    torch.manual_seed(0)
    model = _wrap(variant, build())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(k: int) -> None:
        x, y = make_batch(k)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for k in range(WARMUP_STEPS):
        step(k)
    steady = runtime.handle.memory_stats().allocated or 0
    runtime.handle.reset_peak_memory()
    for k in range(MEASURED_STEPS):
        step(WARMUP_STEPS + k)
    peak = runtime.handle.memory_stats().peak or 0
    both = torch.tensor([peak, peak - steady], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if runtime.is_main:
        out.write_text(json.dumps({"peak": both[0].item(), "transient": both[1].item()}))
    lamina.shutdown()


def _job(workload: str, variant: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peak.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--child",
            workload,
            variant,
            str(out),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result: dict[str, float] = json.loads(out.read_text())
        return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        measure(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="jobs per (workload, variant)")
    parser.add_argument("--only", nargs="*", choices=["mlp", "gpt"], help="run these workloads")
    parser.add_argument("--output", default="zero3_peak_memory.json")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for workload in args.only or ["mlp", "gpt"]:
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                runs[variant].append(_job(workload, variant))
                print(f"  {workload} {variant}: job {repeat + 1}/{args.repeats} done", flush=True)
        median = {
            v: {k: statistics.median(r[k] for r in runs[v]) for k in ("peak", "transient")}
            for v in VARIANTS
        }
        results[workload] = {
            "runs_mib": {v: [{k: r[k] / 2**20 for k in r} for r in runs[v]] for v in VARIANTS},
            "median_peak_mib": {v: median[v]["peak"] / 2**20 for v in VARIANTS},
            "median_transient_mib": {v: median[v]["transient"] / 2**20 for v in VARIANTS},
            "lamina_over_fsdp2_peak": median["lamina"]["peak"] / median["fsdp2"]["peak"],
        }
    print(
        f"{'workload':9}{'lamina peak MiB':>17}{'FSDP2 peak MiB':>16}{'ratio':>8}"
        f"{'lamina step MiB':>17}{'FSDP2 step MiB':>16}"
    )
    for name, r in results.items():
        peak, transient = r["median_peak_mib"], r["median_transient_mib"]
        print(
            f"{name:9}{peak['lamina']:17.1f}{peak['fsdp2']:16.1f}"
            f"{r['lamina_over_fsdp2_peak']:8.3f}"
            f"{transient['lamina']:17.1f}{transient['fsdp2']:16.1f}"
        )
    write_results(
        "zero3_peak_memory",
        args.output,
        {
            "world_size": 2,
            "threads_per_rank": 1,
            "warmup_steps": WARMUP_STEPS,
            "measured_steps": MEASURED_STEPS,
            "repeats": args.repeats,
            "memory": "peak RSS (VmHWM after a reset), slowest rank",
            "variants": list(VARIANTS),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
