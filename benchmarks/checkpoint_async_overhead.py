"""Step time while a checkpoint is saved: synchronous vs ``async_save=True``.

Two gloo ranks (one thread each) train ``_interleaved.py``'s GPT under lamina DP with
AdamW; in every round, interleaved: ``--steps`` plain steps; one step followed by a
synchronous ``CheckpointManager.save``; one step followed by an asynchronous save and
the steps that run while its background thread writes and commits it. Reported (medians
of the slowest rank): a plain step; the step + synchronous save; the step that starts an
async save (its staging copy); and the steps during the background write (including the
one that started it). Run it as::

    python benchmarks/checkpoint_async_overhead.py   # re-launches under torchrun, 2 ranks
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import lamina
from _interleaved import relaunch_under_torchrun, workloads
from _results import write_results
from lamina.checkpoint import CheckpointManager


def still_saving(manager: CheckpointManager) -> bool:
    """Whether any rank's background save is still running: every rank must take the
    same number of steps (each holds collectives), so they decide together."""
    pending = manager._pending is not None and not manager._pending[1].done()
    flag = torch.tensor([int(pending)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="plain steps per round")
    parser.add_argument("--output", default="checkpoint_async_overhead.json")
    args = parser.parse_args()
    relaunch_under_torchrun(__file__)
    torch.set_num_threads(1)
    runtime = lamina.init()
    build, make_batch, loss_fn = workloads(runtime.rank)["gpt"]
    torch.manual_seed(0)
    model = lamina.distribute(build(), "dp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = [0]

    def step() -> None:
        x, y = make_batch(counter[0])
        counter[0] += 1
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"plain": [], "sync": [], "async_start": [], "async_during": []}
    shared: list[Any] = [
        tempfile.mkdtemp(prefix="lamina-ckpt-bench-") if runtime.rank == 0 else None
    ]
    dist.broadcast_object_list(shared, src=0)  # every rank writes to rank 0's directory
    tmp = str(shared[0])
    try:
        sync = CheckpointManager(f"{tmp}/sync", keep=1)
        background = CheckpointManager(f"{tmp}/async", keep=1, async_save=True)
        step()  # warm-up: capture, allocations
        sync.save(0, model, optimizer)
        background.save(0, model, optimizer)
        background.wait()
        for round_ in range(1, args.rounds + 1):
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                step()
                times["plain"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            step()
            sync.save(round_, model, optimizer)
            times["sync"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            step()
            background.save(round_, model, optimizer)
            times["async_start"].append(time.perf_counter() - start)
            times["async_during"].append(times["async_start"][-1])
            while still_saving(background):
                start = time.perf_counter()
                step()
                times["async_during"].append(time.perf_counter() - start)
            background.wait()
            if runtime.is_main:
                print(f"  round {round_}/{args.rounds} done", flush=True)
        background.close()
        size = sum(p.stat().st_size for p in (sync.root / f"step-{args.rounds}").iterdir())
    finally:
        dist.barrier()
        if runtime.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, (medians, {k: len(v) for k, v in times.items()}))
    slowest = {k: max(g[0][k] for g in gathered) for k in medians}
    if runtime.is_main:
        plain = slowest["plain"]
        ratios = {f"{k}_over_plain": v / plain for k, v in slowest.items() if k != "plain"}
        print(f"checkpoint {size / 2**20:.1f} MiB per save, 2 ranks")
        for key, value in slowest.items():
            ratio = f"{value / plain:.3f}x" if key != "plain" else ""
            print(f"{key:14}{value * 1e3:10.1f} ms  {ratio}")
        write_results(
            "checkpoint_async_overhead",
            args.output,
            {
                "ranks": runtime.world_size,
                "rounds": args.rounds,
                "checkpoint_bytes": size,
                "median_step_s": slowest,
                "samples": gathered[0][1],
                **ratios,
            },
        )
    lamina.shutdown()


if __name__ == "__main__":
    main()
