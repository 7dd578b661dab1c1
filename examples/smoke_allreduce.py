"""Smoke run: join the job, all-reduce a buffer on every rank, report what happened.

The same file runs on every backend, launched by torchrun (or ``lamina run`` later):

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/smoke_allreduce.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import lamina


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=16.0, help="buffer size in MiB")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduces")
    args = parser.parse_args()

    with lamina.init() as runtime:
        numel = int(args.mib * 2**20) // 4
        buffer = torch.full((numel,), float(runtime.rank + 1), device=runtime.device)
        dist.all_reduce(buffer)  # warm-up, and the correctness check below
        expected = runtime.world_size * (runtime.world_size + 1) / 2
        if not torch.all(buffer == expected):
            raise SystemExit(f"rank {runtime.rank}: all_reduce gave {buffer[0].item()}")
        times = []
        for _ in range(args.iters):
            runtime.handle.synchronize()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            runtime.handle.synchronize()
            times.append(time.perf_counter() - start)
        median = sorted(times)[len(times) // 2]
        n = runtime.world_size
        busbw = 2 * (n - 1) / n * numel * 4 / median / 1e9 if n > 1 else 0.0
        if runtime.is_main:
            print(
                f"lamina smoke OK: backend={runtime.backend.name} "
                f"collectives={runtime.backend.collective_backend} world={n} "
                f"device={runtime.device} mesh={runtime.mesh}\n"
                f"topology: {runtime.topology.summary()}\n"
                f"all_reduce {args.mib:g} MiB: median {median * 1e3:.1f} ms, "
                f"busbw {busbw:.2f} GB/s over {args.iters} iterations"
            )


if __name__ == "__main__":
    main()
