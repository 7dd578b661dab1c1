"""Fit an MLP to a fixed random "teacher" network: data-parallel training in seconds.

Every rank draws its own inputs (seed + rank); the targets come from a teacher network
built from a fixed seed, so the task is the same everywhere and the loss can reach ~0:

    lamina run --nproc-per-node 2 examples/train_mlp.py
    lamina run --nproc-per-node 2 --backend cuda examples/train_mlp.py --steps 500
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

import lamina
from lamina import ConfigError


def mlp(width: int, depth: int, d_in: int, d_out: int) -> nn.Sequential:
    """``depth`` hidden layers of ``width`` with GELU."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(d_in if i == 0 else width, width), nn.GELU()]
    layers.append(nn.Linear(width if depth else d_in, d_out))
    return nn.Sequential(*layers)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--strategy", choices=("dp", "zero3"), default="dp")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--d-in", type=int, default=32)
    p.add_argument("--d-out", type=int, default=8)
    p.add_argument("--log-every", type=int, default=20, help="steps between loss lines")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.steps, args.batch_size, args.log_every) < 1:
        p.error("--steps, --batch-size and --log-every must be >= 1")
    return args


def mean_over_ranks(value: torch.Tensor) -> float:
    """``value`` averaged over all ranks (a detached scalar)."""
    total = value.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return float(total)


def main(argv: Sequence[str] | None = None) -> int:
    """Train; returns the process exit status."""
    args = parse_args(argv)
    with lamina.init() as rt:
        torch.manual_seed(12345)  # the teacher is the same on every rank and every run
        teacher = mlp(64, 2, args.d_in, args.d_out).to(rt.device).requires_grad_(False)
        torch.manual_seed(args.seed)
        net = mlp(args.width, args.depth, args.d_in, args.d_out).to(rt.device)
        try:
            model = lamina.distribute(net, strategy=args.strategy)
        except ConfigError as exc:
            if rt.is_main:
                print(f"train_mlp.py: error: --strategy {args.strategy}: {exc}", file=sys.stderr)
            return 2
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        generator = torch.Generator().manual_seed(args.seed + rt.rank)
        first = last = float("nan")
        rt.handle.synchronize()
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            x = torch.randn(args.batch_size, args.d_in, generator=generator).to(rt.device)
            loss = nn.functional.mse_loss(model(x), teacher(x))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                last = mean_over_ranks(loss)
                first = last if step == 1 else first
                if rt.is_main:
                    print(f"step {step:>5}/{args.steps}  loss {last:.6f}", flush=True)
        rt.handle.synchronize()
        elapsed = time.perf_counter() - start
        if rt.is_main:
            print(
                f"done: {args.steps} steps on {rt.world_size} rank(s) ({rt.backend.name}) | "
                f"loss {first:.6f} -> {last:.6f} | {elapsed:.2f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
