"""lamina tp=2 x zero3=2 vs torch's own 2-D (parallelize_module + fully_shard) vs lamina
HSDP, interleaved, on 4 ranks.

Four gloo ranks, one thread each, on a mesh of 2 hosts x 2 ranks (``inter`` x ``intra``
from the topology's fast domains: a declared topology on loopback, the probed one under
``lamina emulate``), so tensor parallelism stays inside each host. The examples' GPT at
the benchmarks' size (``_interleaved.gpt``: 4 layers, d 256, vocab 8192, batch 8 x 128
tokens), AdamW. Variants:

- ``lamina_tp_zero3``: ``lamina.distribute(model, ["tp", "zero3"])``, tp on ``intra``,
  ZeRO-3 on ``inter``; the plan derived from the graph;
- ``torch_2d``: torch's ``parallelize_module`` on ``mesh["intra"]`` with the same plan
  (lamina's derived plan as torch ``ParallelStyle`` objects, ``torch_styles``), then
  ``fully_shard`` of every block and the root on ``mesh["inter"]`` (FSDP2 over DTensor
  parameters);
- ``lamina_hsdp``: ``lamina.distribute(model, "hsdp")`` (shards inside a host, replicas
  across), each rank its own data.

Sequence parallelism is on in both 2-D variants (torch's from the same plan: the GPT
adds learned positions to the token embedding, so the first block's input is sliced, as
lamina does, by ``PrepareModuleInput``); the tied embedding and head share one weight in
both; both compute the loss on the vocabulary-split logits (``lamina.loss_parallel``,
torch's ``loss_parallel``), as torchtitan does. torch's ``ColwiseParallel`` splits the
fused q/k/v projection by contiguous rows (lamina chunk by chunk, so each rank holds
whole heads): the same FLOPs and bytes, not the same heads (the JSON says so). The
ranks of a tp group share their batch. Rounds rotate the variants' order; medians of
the slowest rank.

Each variant then runs alone in processes of its own for its peak RSS (one process's
high-water mark holds every variant's model), ``--alone-repeats`` times, interleaved:
the median is ``peak_rss_alone_bytes``.

    python benchmarks/tp_vs_torch.py                       # loopback, declared 2 x 2
    python benchmarks/tp_vs_torch.py --emulate 800mbit     # under lamina emulate (root)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lamina
from _interleaved import gpt
from _results import RESULTS, write_results
from emulated_training import INNER_ENV, run_emulated
from hsdp_vs_fsdp2 import declared_topology
from lamina.session import TOPOLOGY_ENV
from lamina.strategies.contract import Placement
from lamina.strategies.tp.derive import derive_plan
from lamina.strategies.tp.styles import torch_styles

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import lm_loss

VARIANTS = ("lamina_tp_zero3", "torch_2d", "lamina_hsdp")
VOCAB, BATCH, SEQ = 8192, 8, 128


def batch(step: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets of ``step`` for data shard ``data_rank``."""
    gen = torch.Generator().manual_seed(step * 97 + data_rank)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def torch_2d(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """torch's 2-D: lamina's derived plan as ParallelStyles through ``parallelize_module``
    on the ``intra`` axis, then FSDP2 on ``inter``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    runtime = lamina.current()
    assert runtime is not None
    mesh = runtime.mesh.torch_mesh
    plan = derive_plan(model, (example,), None, mesh["intra"].size(), sequence_parallel=True)
    tied = model.head.weight is model.tok.weight  # type: ignore[union-attr]
    styles = torch_styles(plan)
    # torch's loss parallelism, as lamina's: the head's logits stay split by vocabulary
    styles["head"] = ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    )
    parallelize_module(model, mesh["intra"], styles)
    if tied:  # parallelize_module gives the head and the embedding one weight each
        model.head.weight = model.tok.weight  # type: ignore[union-attr]
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh["inter"])
    fully_shard(model, mesh=mesh["inter"])
    return model


def loss_context(variant: str, model: nn.Module) -> AbstractContextManager[Any]:
    """Each 2-D variant's loss parallelism (cross entropy on the vocabulary-split logits,
    never gathered): lamina's and torch's own; none for HSDP (whole logits)."""
    if variant == "lamina_tp_zero3":
        return lamina.loss_parallel(model)
    if variant == "torch_2d":
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()


def wrap(variant: str, model: nn.Module, example: torch.Tensor) -> nn.Module:
    """``model`` distributed as ``variant`` says."""
    if variant == "lamina_tp_zero3":
        return lamina.distribute(
            model,
            ["tp", "zero3"],
            placement={"tp": Placement(shard=("intra",)), "zero3": Placement(shard=("inter",))},
            example_inputs=(example,),
            sequence_parallel=True,
        )
    if variant == "torch_2d":
        return torch_2d(model, example)
    return lamina.distribute(model, "hsdp")


def run(args: argparse.Namespace, setting: str) -> None:
    """One rank's part: time the variants, interleaved; rank 0 writes the results. With
    ``--alone VARIANT``: that variant only, its process's peak RSS (``VmHWM``) written to
    ``--alone-out``."""
    torch.set_num_threads(1)
    runtime = lamina.init(mesh="topology")
    coords = runtime.mesh.coordinates()
    models: dict[str, nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    example = batch(0, 0)[0]
    variants = (args.alone,) if args.alone else VARIANTS
    for variant in variants:
        torch.manual_seed(0)
        models[variant] = wrap(variant, gpt(), example)
        opts[variant] = torch.optim.AdamW(models[variant].parameters(), lr=1e-4)
    if args.alone:
        alone(args, runtime, models[args.alone], opts[args.alone], coords)
        return
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks = dict.fromkeys(VARIANTS, 0)
    step = 0
    for round_ in range(args.rounds + 1):  # round 0 warms up
        k = round_ % len(VARIANTS)
        for variant in [*VARIANTS[k:], *VARIANTS[:k]]:
            model, opt = models[variant], opts[variant]
            data_rank = runtime.rank if variant == "lamina_hsdp" else coords["inter"]
            dist.barrier()
            runtime.handle.reset_peak_memory()
            for _ in range(args.steps):
                x, y = batch(step, data_rank)
                step += 1
                start = time.perf_counter()
                with loss_context(variant, model):
                    loss = lm_loss(model(x), y)
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if round_ > 0:
                    times[variant].append(time.perf_counter() - start)
            peaks[variant] = max(peaks[variant], runtime.handle.memory_stats().peak or 0)
        if runtime.is_main:
            print(f"  {setting}: round {round_}/{args.rounds} done", flush=True)
    medians = {v: statistics.median(times[v]) for v in VARIANTS}
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, (medians, peaks))
    if runtime.is_main:
        step_s = {v: max(g[0][v] for g in gathered) for v in VARIANTS}
        rss = {v: max(g[1][v] for g in gathered) for v in VARIANTS}
        ratios = {
            "lamina_tp_zero3_over_torch_2d": step_s["lamina_tp_zero3"] / step_s["torch_2d"],
            "lamina_tp_zero3_over_torch_2d_peak_rss": rss["lamina_tp_zero3"] / rss["torch_2d"],
            "lamina_tp_zero3_over_lamina_hsdp": step_s["lamina_tp_zero3"] / step_s["lamina_hsdp"],
        }
        print(f"\n{setting}: median step (slowest rank), peak RSS (largest rank)")
        for v in VARIANTS:
            print(f"  {v:18} {step_s[v] * 1e3:9.1f} ms  {rss[v] / 2**20:8.1f} MiB")
        for name, value in ratios.items():
            print(f"  {name:42} {value:.3f}")
        plan = models["lamina_tp_zero3"].execution_plan  # type: ignore[union-attr]
        write_results(
            "tp_vs_torch",
            f"tp_vs_torch_{setting}.json",
            {
                "setting": setting,
                "link": args.emulate or "loopback",
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "steps_timed_per_variant": len(times[VARIANTS[0]]),
                "model": "examples GPT: 4 layers, d_model 256, 4 heads, vocab 8192, tied head",
                "batch": [BATCH, SEQ],
                "mesh": {"axes": list(runtime.mesh.axis_names), "ranks": runtime.mesh.ranks()},
                "median_step_s": step_s,
                "peak_rss_bytes": rss,
                **ratios,
                "lamina_strategy": plan.strategy,
                "lamina_layer_plan": dict(plan.meta).get("layer_plan", "").split("\n"),
                "sequence_parallel": True,
                "note": (
                    "torch's ColwiseParallel splits the fused qkv projection by contiguous "
                    "rows, lamina chunk by chunk (whole heads per rank): same FLOPs and bytes"
                ),
            },
        )
    lamina.shutdown()


def alone(
    args: argparse.Namespace,
    runtime: lamina.Runtime,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    coords: dict[str, int],
) -> None:
    """A few steps of one variant in a process of its own; rank 0 writes the largest
    rank's peak RSS (the whole process: model, optimizer state, activations)."""
    data_rank = runtime.rank if args.alone == "lamina_hsdp" else coords["inter"]
    for step in range(3):
        x, y = batch(step, data_rank)
        with loss_context(args.alone, model):
            loss = lm_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = runtime.handle.memory_stats().peak or 0
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, peak)
    if runtime.is_main:
        Path(args.alone_out).write_text(json.dumps({"peak_rss_bytes": max(gathered)}))
    lamina.shutdown()


def launch(argv: list[str], emulate: str, topology: str) -> int:
    """This script on 4 ranks with ``argv``: under lamina emulate, or torchrun on
    loopback with the declared ``topology``."""
    if emulate:
        return run_emulated(emulate, __file__, argv)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "4", __file__, *argv,
    ]  # fmt: skip
    return subprocess.call(cmd, env={**os.environ, TOPOLOGY_ENV: topology})


def measure(args: argparse.Namespace, topology: str) -> int:
    """The interleaved timing run, then each variant alone for its peak RSS; the results
    JSON gains ``peak_rss_alone_bytes`` and its ratio."""
    argv = list(sys.argv[1:])
    status = launch(argv, args.emulate, topology)
    if status:
        return status
    setting = "emulated" if args.emulate else "loopback"
    results = RESULTS / f"tp_vs_torch_{setting}.json"
    runs: dict[str, list[int]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="lamina-tp-alone-") as tmp:
        for repeat in range(args.alone_repeats):  # interleaved: A, B, C, A, B, C, ...
            for variant in VARIANTS:
                out = str(Path(tmp) / f"{variant}-{repeat}.json")
                print(f"{setting}: {variant} alone ({repeat + 1}), for its peak RSS", flush=True)
                alone_argv = [*argv, "--alone", variant, "--alone-out", out]
                status = launch(alone_argv, args.emulate, topology)
                if status:
                    return status
                runs[variant].append(json.loads(Path(out).read_text())["peak_rss_bytes"])
    alone_peaks = {v: int(statistics.median(r)) for v, r in runs.items()}
    data = json.loads(results.read_text())
    data["peak_rss_alone_bytes"] = alone_peaks
    data["peak_rss_alone_runs_bytes"] = runs
    data["lamina_tp_zero3_over_torch_2d_peak_rss_alone"] = (
        alone_peaks["lamina_tp_zero3"] / alone_peaks["torch_2d"]
    )
    results.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    for variant, peak in alone_peaks.items():
        print(f"  {variant:18} peak RSS alone {peak / 2**20:8.1f} MiB")
    ratio = data["lamina_tp_zero3_over_torch_2d_peak_rss_alone"]
    print(f"  lamina_tp_zero3_over_torch_2d_peak_rss_alone {ratio:.3f}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument(
        "--emulate", default="", help="link speed under lamina emulate, e.g. 800mbit (root)"
    )
    parser.add_argument(
        "--alone-repeats", type=int, default=3, help="runs of each variant alone (median peak)"
    )
    parser.add_argument("--alone", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--alone-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" in os.environ:  # a rank of one of the launches below
        run(args, "emulated" if os.environ.get(INNER_ENV) else "loopback")
        return
    with tempfile.TemporaryDirectory(prefix="lamina-tp-bench-") as tmp:
        path = str(Path(tmp) / "topology.json")
        Path(path).write_text(json.dumps(declared_topology(2, 2), indent=2))
        sys.exit(measure(args, path))


if __name__ == "__main__":
    main()
