"""The FP8 two-phase sum against the fp32 all-reduce on an emulated 2-host cluster.

Runs itself under ``lamina emulate`` like ``emulated_training.py`` (2 hosts x 2 gloo
ranks, interleaved, each uplink shaped to ``--link``). One buffer of ``--mb`` MiB of
correlated gradients (a shared part plus per-rank noise, as data-parallel ranks have)
is summed, interleaved round by round, by:

- ``fp32``: ``dist.all_reduce`` on the job's group (gloo's ring);
- ``fp8``: :class:`lamina.comm.fp8.Fp8Sum` on the same group with the backend's kernels,
  as DP runs it (e4m3 payload in blocks of 128 with power-of-two scales: all_to_all,
  fp32 sum, all-gather).

Reports the medians of the slowest rank, the ratio, the bytes each rank sends and the
fp8 result's relative L2 and L-inf error against the exact fp32 sum: of one sum, and of
``--steps`` sums of fresh gradients accumulated (what the optimizer integrates), without
and with error feedback. Needs root::

    python benchmarks/emulated_fp8.py     # writes results/emulated_fp8.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import lamina
from _results import write_results
from emulated_training import relaunch_emulated
from lamina.comm.fp8 import Fp8Settings, Fp8Sum, all_reduce_fp8, wire_bytes


def slowest(seconds: float) -> float:
    """The slowest rank's value."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def accumulated_error(
    rank: int, numel: int, steps: int, feedback: bool, launcher: Any
) -> dict[str, float]:
    """Relative L2 and L-inf error of ``steps`` fp8 sums, accumulated, against the exact
    accumulated sum. Each step's gradients are a direction shared by the steps and the
    ranks, plus noise of the step and of the rank (consecutive gradients correlate, as
    in training)."""
    fp8 = Fp8Sum(Fp8Settings(error_feedback=feedback, launcher=launcher))
    exact_total = torch.zeros(numel)
    fp8_total = torch.zeros(numel)
    direction = torch.randn(numel, generator=torch.Generator().manual_seed(999))
    for step in range(steps):
        shared = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + step))
        noise = torch.randn(numel, generator=torch.Generator().manual_seed(rank + 7 * step))
        grad = direction + 0.5 * shared + 0.3 * noise
        exact = grad.clone()
        dist.all_reduce(exact)
        exact_total += exact
        fp8_total += fp8.run(grad)[:numel]
        fp8.commit(True)
    diff = fp8_total - exact_total
    return {
        "relative_l2": float(diff.norm() / exact_total.norm()),
        "relative_linf": float(diff.abs().max() / exact_total.abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="200mbit", help="emulated link speed (200mbit)")
    parser.add_argument("--mb", type=float, default=8.0, help="MiB of fp32 gradients (8)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (7)")
    parser.add_argument("--steps", type=int, default=16, help="steps accumulated (16)")
    parser.add_argument("--output", default="emulated_fp8.json")
    args = parser.parse_args()
    relaunch_emulated(args.link, __file__)
    torch.set_num_threads(1)
    runtime = lamina.init()
    world = runtime.world_size
    numel = int(args.mb * 2**20 / 4)
    shared = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(1 + runtime.rank))
    grad = shared + 0.3 * noise
    exact = grad.clone()
    dist.all_reduce(exact)

    def fp32(buffer: torch.Tensor) -> None:
        dist.all_reduce(buffer)

    summing = Fp8Sum(Fp8Settings(error_feedback=False, launcher=runtime.kernels))  # what DP runs

    def fp8(buffer: torch.Tensor) -> None:
        buffer.copy_(summing.run(buffer)[:numel])

    variants = {"fp32": fp32, "fp8": fp8}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        names = list(variants)
        names = names[round_ % 2 :] + names[: round_ % 2]  # rotate the order
        for name in names:
            buffer = grad.clone()
            dist.barrier()
            start = time.perf_counter()
            variants[name](buffer)
            elapsed = slowest(time.perf_counter() - start)
            if round_:
                times[name].append(elapsed)
        if runtime.is_main:
            print(f"  round {round_}/{args.rounds} done", flush=True)
    result = grad.clone()
    all_reduce_fp8(result)
    error = {
        "relative_l2": float((result - exact).norm() / exact.norm()),
        "relative_linf": float((result - exact).abs().max() / exact.abs().max()),
    }
    accumulated = {
        name: accumulated_error(runtime.rank, numel, args.steps, feedback, runtime.kernels)
        for name, feedback in (("without_feedback", False), ("with_feedback", True))
    }
    medians = {name: statistics.median(v) for name, v in times.items()}
    sent = {"fp32": 2 * (world - 1) * 4 * numel // world, "fp8": wire_bytes(numel, world)}
    if runtime.is_main:
        print(f"{args.mb:g} MiB on {world} ranks, link {args.link}")
        for name in variants:
            mib = sent[name] / 2**20
            print(f"{name:6}{medians[name] * 1e3:10.1f} ms  {mib:8.2f} MiB sent per rank")
        print(
            f"fp8/fp32 time {medians['fp8'] / medians['fp32']:.3f}, bytes "
            f"{sent['fp8'] / sent['fp32']:.3f}; fp8 error L2 {error['relative_l2']:.2e}, "
            f"L-inf {error['relative_linf']:.2e}"
        )
        for name, err in accumulated.items():
            print(
                f"{args.steps} steps accumulated {name.replace('_', ' ')}: L2 "
                f"{err['relative_l2']:.2e}, L-inf {err['relative_linf']:.2e}"
            )
        write_results(
            "emulated_fp8",
            args.output,
            {
                "link": args.link,
                "world_size": world,
                "mib": args.mb,
                "rounds": args.rounds,
                "median_s": medians,
                "bytes_sent_per_rank": sent,
                "fp8_over_fp32_time": medians["fp8"] / medians["fp32"],
                "fp8_over_fp32_bytes": sent["fp8"] / sent["fp32"],
                "fp8_error": error,
                "accumulated_steps": args.steps,
                "fp8_accumulated_error": accumulated,
            },
        )
    lamina.shutdown()


if __name__ == "__main__":
    main()
