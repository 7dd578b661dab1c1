"""An nccl-tests-style sweep of the collectives on the current backend, on every rank.

Launched by ``lamina bench collectives`` under torchrun (``python -m
lamina.bench.collectives ...`` on each rank; run directly it is a one-rank job). For
each op and each size (powers of two from ``--min-bytes`` to ``--max-bytes``, float32
elements) every rank runs ``--warmup`` untimed and ``--iters`` timed calls, each timed
to the device's completion; the reported time is the slowest rank's median. Sizes
count the nccl-tests way: all_reduce/broadcast the buffer, all_gather the gathered
output, reduce_scatter and all_to_all the input. algbw = bytes / time and busbw =
algbw x :func:`lamina.trace.events.busbw_factor`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lamina.bench.sweep_options import (
    OPS,
    add_sweep_arguments,
    check_sweep_arguments,
)
from lamina.errors import ConfigError, LaminaError
from lamina.trace.events import busbw_factor
from lamina.units import format_bytes

DTYPE = torch.float32


@dataclass(frozen=True)
class Result:
    """One op at one size: the slowest rank's median time and the bandwidths."""

    op: str
    bytes: int
    numel: int
    ranks: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    busbw_factor: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready record."""
        return asdict(self)


def _prepare(op: str, nbytes: int, n: int, device: torch.device) -> tuple[Callable[[], Any], int]:
    """The call that runs ``op`` on about ``nbytes`` and the element count it moves."""
    count = nbytes // DTYPE.itemsize
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        count -= count % n  # every rank's share must be whole
    if count < 1:
        return (lambda: None), 0

    def zeros(numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=DTYPE, device=device)

    if op == "all_reduce":
        buf = zeros(count)
        return (lambda: dist.all_reduce(buf)), count
    if op == "broadcast":
        buf = zeros(count)
        return (lambda: dist.broadcast(buf, src=0)), count
    if op == "all_gather":
        out, part = zeros(count), zeros(count // n)
        return (lambda: dist.all_gather_into_tensor(out, part)), count
    if op == "reduce_scatter":
        full, part = zeros(count), zeros(count // n)
        return (lambda: dist.reduce_scatter_tensor(part, full)), count
    if op == "all_to_all":
        src, dst = zeros(count), zeros(count)
        return (lambda: dist.all_to_all_single(dst, src)), count
    raise ConfigError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def measure(
    op: str, nbytes: int, *, iters: int, warmup: int, device: torch.device, sync: Callable[[], None]
) -> Result | None:
    """Time ``op`` at ``nbytes`` on every rank; None when the size holds no whole share."""
    n = dist.get_world_size()
    call, numel = _prepare(op, nbytes, n, device)
    if numel == 0:
        return None
    with warnings.catch_warnings():  # *_into_tensor / *_tensor are deprecated in new torch
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        for _ in range(warmup):
            call()
        sync()
        _align(device, sync)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds = max(float(slowest.item()), 1e-9)
    moved = numel * DTYPE.itemsize
    factor = busbw_factor(op, n)
    algbw = moved / seconds / 1e9
    return Result(op, moved, numel, n, seconds * 1e6, algbw, algbw * factor, factor)


def _align(device: torch.device, sync: Callable[[], None]) -> None:
    """A tiny all-reduce as a barrier (``dist.barrier`` guesses devices on some backends)."""
    dist.all_reduce(torch.zeros(1, device=device))
    sync()


#: The table's columns, as nccl-tests prints them (sizes in bytes).
HEADER = (
    f"{'size(B)':>12} {'count':>12} {'op':>15} {'time(us)':>12} {'algbw(GB/s)':>12} "
    f"{'busbw(GB/s)':>12}"
)


def format_row(result: Result) -> str:
    """One table row."""
    return (
        f"{result.bytes:>12} {result.numel:>12} {result.op:>15} "
        f"{result.time_us:>12.1f} {result.algbw_gbps:>12.4f} {result.busbw_gbps:>12.4f}"
    )


def run(args: argparse.Namespace) -> list[Result]:
    """Initialize lamina, sweep, print the table on rank 0 (and write ``--json``)."""
    import lamina

    sizes = check_sweep_arguments(args)
    runtime = lamina.init()
    main_rank = runtime.rank == 0

    def sync() -> None:
        runtime.handle.synchronize(runtime.device)

    def say(line: str) -> None:
        if main_rank:
            print(line, flush=True)

    say(
        f"lamina bench collectives: {runtime.world_size} rank(s), backend {runtime.backend.name} "
        f"({runtime.backend.collective_backend}), float32, {args.iters} iters, "
        f"{args.warmup} warmup; time = slowest rank's median"
    )
    report: dict[str, Any] = {
        "world_size": runtime.world_size,
        "backend": runtime.backend.name,
        "collective_backend": runtime.backend.collective_backend,
        "device": str(runtime.device),
        "dtype": "float32",
        "iters": args.iters,
        "warmup": args.warmup,
    }
    try:
        if args.algorithm:
            results: list[Any] = _algorithm_sweep(args, sizes, runtime, sync, say, report)
        else:
            say(HEADER)
            results = _sweep(args, sizes, runtime.device, sync, say)
            report["results"] = [r.to_json() for r in results]
    finally:
        lamina.shutdown()
    if main_rank and args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        say(f"results written to {args.json}")
    return results


def _algorithm_sweep(
    args: argparse.Namespace,
    sizes: list[int],
    runtime: Any,
    sync: Callable[[], None],
    say: Callable[[str], None],
    report: dict[str, Any],
) -> list[Any]:
    from lamina.bench.algorithms import sweep

    model, results = sweep(
        runtime.topology,
        runtime.rank,
        runtime.backend.collective_backend,
        args.algorithm,
        sizes,
        iters=args.iters,
        warmup=args.warmup,
        device=runtime.device,
        sync=sync,
        say=say,
        calibrated=not args.no_calibrate,
    )
    report["model"] = model.to_json()
    report["algorithms"] = [r.to_json() for r in results]
    return results


def _sweep(
    args: argparse.Namespace,
    sizes: list[int],
    device: torch.device,
    sync: Callable[[], None],
    say: Callable[[str], None],
) -> list[Result]:
    results: list[Result] = []
    for op in args.ops:
        for size in sizes:
            result = measure(
                op, size, iters=args.iters, warmup=args.warmup, device=device, sync=sync
            )
            if result is None:
                say(f"{size:>12} {'-':>12} {op:>15}   (skipped: no whole share per rank)")
                continue
            results.append(result)
            say(format_row(result))
    for op in args.ops:
        mine = [r for r in results if r.op == op]
        if mine:
            best = max(mine, key=lambda r: r.busbw_gbps)
            say(f"peak busbw {op}: {best.busbw_gbps:.4f} GB/s at {format_bytes(best.bytes)}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of every rank (``python -m lamina.bench.collectives``)."""
    parser = argparse.ArgumentParser(
        prog="python -m lamina.bench.collectives",
        description="Sweep the collectives over sizes on this job's ranks.",
    )
    add_sweep_arguments(parser)
    try:
        run(parser.parse_args(argv))
    except LaminaError as exc:
        print(f"lamina bench: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
