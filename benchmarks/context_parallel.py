"""Context parallelism (``"cp"``) against one process: activation memory and step time.

Two parts, each on its own torchrun job (the script re-launches itself):

- ``memory`` (4 ranks): the examples' GPT (d_model 128, 4 layers, 4 heads, vocab 64) on
  one sequence of ``--memory-tokens`` (16384) tokens. Activation memory is what autograd
  keeps for backward: the bytes of every distinct storage saved by the forward
  (``torch.autograd.graph.saved_tensors_hooks``; the cp attention saves its tensors
  through autograd too), the cross-entropy of the loop included. One process (rank 0
  alone, before the others start) against each rank under ``cp=4``, each algorithm.
- ``speed`` (2 ranks, one thread each): an attention-dominated GPT (d_model 64, 2 layers,
  4 heads, vocab 64) on one sequence of ``--speed-tokens`` (8192) tokens; SGD steps of one
  process (rank 0, the other rank waiting at a barrier) and of ``cp=2`` under each
  algorithm, in rounds of ``--steps`` steps with the order rotating (round 0 warms up),
  medians. Each rank's attention compute (the block kernels, forward and backward, without
  waits) is timed too, with and without head/tail load balancing.

The table prints; the JSON goes to ``results/context_parallel.json``::

    python benchmarks/context_parallel.py [--part memory speed] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lamina
from _interleaved import relaunch_under_torchrun, torchrun_command
from _results import RESULTS, write_results
from lamina.strategies.cp import blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig, lm_loss

ALGORITHMS = ("pass_kv", "all_gather", "all_to_all")
VOCAB = 64


def _model(tokens: int, d_model: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(vocab_size=VOCAB, seq_len=tokens, d_model=d_model, n_layers=layers, n_heads=4)
    )


def _batch(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (1, tokens), generator=g), torch.randint(
        0, VOCAB, (1, tokens), generator=g
    )


def saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the distinct storages the forward and loss save for backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x), y)
    loss.backward()
    return sum(seen.values())


def memory_part(tokens: int) -> dict[str, Any]:
    rank = dist.get_rank()
    x, y = _batch(tokens)
    results: dict[str, Any] = {"tokens": tokens}
    if rank == 0:
        results["one_process_bytes"] = saved_bytes(_model(tokens, 128, 4), x, y)
    dist.barrier()
    for algorithm in ALGORITHMS:
        model = lamina.distribute(
            _model(tokens, 128, 4), "cp", example_inputs=(x,), attention=algorithm
        )
        mine = torch.tensor([saved_bytes(model, x, y)], dtype=torch.float64)
        peak = mine.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        results[f"cp_{algorithm}_bytes"] = int(peak.item())
    return results


class _ComputeClock:
    """Seconds inside the block kernels (forward and backward), this rank."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def installed(self) -> Iterator[None]:
        originals = (blocks.BlockAttention.forward, blocks.BlockAttention.backward)

        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            return run

        blocks.BlockAttention.forward = timed(originals[0])  # type: ignore[method-assign]
        blocks.BlockAttention.backward = timed(originals[1])  # type: ignore[method-assign]
        try:
            yield
        finally:
            blocks.BlockAttention.forward, blocks.BlockAttention.backward = originals  # type: ignore[method-assign]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def speed_part(tokens: int, rounds: int, steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    x, y = _batch(tokens)
    base = _model(tokens, 64, 2)
    variants: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    single = copy.deepcopy(base)
    variants["one_process"] = (single, torch.optim.SGD(single.parameters(), lr=0.01))
    for algorithm in ALGORITHMS:
        model = lamina.distribute(
            copy.deepcopy(base), "cp", example_inputs=(x,), attention=algorithm
        )
        variants[algorithm] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    unbalanced = lamina.distribute(
        copy.deepcopy(base), "cp", example_inputs=(x,), attention="pass_kv", load_balance=False
    )
    variants["pass_kv_unbalanced"] = (unbalanced, torch.optim.SGD(unbalanced.parameters(), lr=0.01))
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    compute: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(rounds + 1):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            model, opt = variants[name]
            for _ in range(steps):
                dist.barrier()
                clock = _ComputeClock()
                if name == "one_process":
                    took = _step(model, opt, x, y) if rank == 0 else 0.0
                else:
                    with clock.installed():
                        took = _step(model, opt, x, y)
                slowest = torch.tensor([took], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if round_:
                    times[name].append(float(slowest.item()))
                    compute[name].append(clock.seconds)
            if rank == 0 and round_:
                print(
                    f"round {round_}: {name} {statistics.median(times[name][-steps:]):.3f} s",
                    flush=True,
                )
    medians = {n: statistics.median(v) for n, v in times.items()}
    per_rank = torch.tensor(
        [statistics.median(compute[n]) if compute[n] else 0.0 for n in names], dtype=torch.float64
    )
    gathered = [torch.zeros_like(per_rank) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, per_rank)
    attention = {
        n: [float(g[k]) for g in gathered] for k, n in enumerate(names) if n != "one_process"
    }
    return {
        "tokens": tokens,
        "steps_timed_per_variant": rounds * steps,
        "median_step_s": medians,
        "over_one_process": {
            n: medians[n] / medians["one_process"] for n in names if n != "one_process"
        },
        "attention_compute_s_per_rank": attention,
        "attention_imbalance": {
            n: max(v) / min(v) - 1.0 for n, v in attention.items() if min(v) > 0
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--part", nargs="+", default=["memory", "speed"], choices=["memory", "speed"]
    )
    parser.add_argument("--memory-tokens", type=int, default=16384)
    parser.add_argument("--speed-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", default="context_parallel.json")
    parser.add_argument("--in-job", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.in_job:
        import json
        import subprocess

        fields: dict[str, Any] = {}
        for part, nproc in (("memory", 4), ("speed", 2)):
            if part not in args.part:
                continue
            partial = RESULTS / f".context_parallel_{part}.json"
            argv = [*sys.argv[1:], "--in-job", str(partial)]
            cmd = torchrun_command(__file__, nproc, argv)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "LAMINA_BACKEND": "cpu"}
            if subprocess.call(cmd, env=env):
                sys.exit(f"the {part} job failed")
            fields[part] = json.loads(partial.read_text())
            partial.unlink()
        _report(fields)
        write_results("context_parallel", args.output, fields)
        return
    relaunch_under_torchrun(__file__)
    part = Path(args.in_job).name.split("_")[-1].split(".")[0]
    torch.set_num_threads(1)
    lamina.init(mesh={"cp": int(os.environ["WORLD_SIZE"])})
    if part == "memory":
        result = memory_part(args.memory_tokens)
    else:
        result = speed_part(args.speed_tokens, args.rounds, args.steps)
    if dist.get_rank() == 0:
        import json

        Path(args.in_job).write_text(json.dumps(result))
    lamina.shutdown()


def _report(fields: dict[str, Any]) -> None:
    memory = fields.get("memory")
    if memory:
        one = memory["one_process_bytes"]
        print(f"\nactivation memory, {memory['tokens']} tokens, cp=4 (per rank, the largest):")
        print(f"{'variant':<14}{'MiB':>10}{'x one process':>16}")
        print(f"{'one process':<14}{one / 2**20:>10.1f}{1.0:>16.3f}")
        for algorithm in ALGORITHMS:
            got = memory[f"cp_{algorithm}_bytes"]
            print(f"{algorithm:<14}{got / 2**20:>10.1f}{got / one:>16.3f}")
    speed = fields.get("speed")
    if speed:
        print(f"\nstep time, {speed['tokens']} tokens, cp=2, one thread per rank (medians):")
        print(f"{'variant':<20}{'s/step':>10}{'x one process':>16}{'attention imbalance':>22}")
        for name, seconds in speed["median_step_s"].items():
            ratio = speed["over_one_process"].get(name, 1.0)
            imbalance = speed["attention_imbalance"].get(name)
            shown = f"{imbalance * 100:.1f}%" if imbalance is not None else "-"
            print(f"{name:<20}{seconds:>10.3f}{ratio:>16.3f}{shown:>22}")


if __name__ == "__main__":
    main()
