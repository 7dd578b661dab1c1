"""lamina tp=2 x zero3=2 vs torch's own 2-D (parallelize_module + fully_shard) vs lamina
HSDP, interleaved, on 4 ranks.

Four gloo ranks, one thread each, on a mesh of 2 hosts x 2 ranks (``inter`` x ``intra``
from the topology's fast domains: a declared topology on loopback, the probed one under
``lamina emulate``), so tensor parallelism stays inside each host. ``--model gpt`` (the
default): the examples' GPT at the benchmarks' size (``_interleaved.gpt``: 4 layers, d
256, vocab 8192); ``--model qwen3``: transformers' ``Qwen3ForCausalLM`` in today's style
at about the GPT's step time (4 layers, hidden 256, 8 heads of 32 with 4 key/value heads,
q/k RMSNorm per head, SwiGLU 768, rotary positions, sdpa, vocab 8192, untied head).
Batch 8 x 128 tokens, AdamW. Variants:

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

Qwen3 (``--model qwen3``, results in ``tp_vs_torch_qwen3_<setting>.json``):

- q, k and v are separate projections, so torch's ``ColwiseParallel`` on each gives
  every rank whole heads too (4 of 8 query heads, 2 of 4 key/value heads): the same
  heads as lamina, not only the same FLOPs and bytes;
- both keep the embedding's output whole (summed over tp) and slice the sequence
  entering ``model.layers.0``: HF computes the positions, the rotary table and the
  causal mask from the embedding's output, so the derived plan does not let the
  embedding reduce-scatter onto the slices (``split_at_embedding`` is off for it);
- the loss is the GPT path's: ``lm_loss`` on ``.logits`` inside ``lamina.loss_parallel``
  / torch's ``loss_parallel``. HF's forward returns the head's output untouched as
  ``.logits`` (no loss without ``labels``), so both loss parallelisms apply (checked
  against one process: the same loss);
- the per-head q/k RMSNorm weights meet activations split by heads: lamina's plan keeps
  them whole and sums their gradients over tp ("whole, gradients summed" in the layer
  plan). torch does what ``torch_styles`` gives them, recorded in the JSON's
  ``qk_norm``: ``SequenceParallel(sequence_dim=2)`` makes the weight a replicated
  DTensor on an input marked split by heads, so its gradient is ``Partial`` and DTensor
  all-reduces it over tp (the same sum); with no style the weight stays a plain tensor
  that FSDP2 shards on ``inter`` only, each tp rank's gradient is its own heads' part,
  never summed over tp, and the tp ranks' copies drift apart (checked: rank 0's and
  rank 1's gradients add up to one process's).

Each variant then runs alone in processes of its own for its peak RSS (one process's
high-water mark holds every variant's model), ``--alone-repeats`` times, interleaved:
the median is ``peak_rss_alone_bytes``.

    python benchmarks/tp_vs_torch.py                       # loopback, declared 2 x 2
    python benchmarks/tp_vs_torch.py --model qwen3         # tp_vs_torch_qwen3_loopback.json
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
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

import lamina
from _interleaved import gpt
from _results import RESULTS, write_results
from emulated_training import INNER_ENV, run_emulated
from hsdp_vs_fsdp2 import declared_topology
from lamina.runtime.plan import ExecutionPlan
from lamina.session import TOPOLOGY_ENV
from lamina.strategies.contract import Placement
from lamina.strategies.tp.derive import derive_plan
from lamina.strategies.tp.styles import torch_styles

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import lm_loss

VARIANTS = ("lamina_tp_zero3", "torch_2d", "lamina_hsdp")
VOCAB, BATCH, SEQ = 8192, 8, 128


def qwen3() -> nn.Module:
    """transformers' Qwen3 at about the GPT's step time: 4 layers, hidden 256, 8 heads of
    32 (4 key/value heads), MLP 768, vocab 8192, untied head, sdpa attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(Qwen3Config(**settings))


@dataclass(frozen=True)
class Workload:
    """One model the benchmark runs: how to build it, its blocks (FSDP2's units), what
    the JSON says of it."""

    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], Any]
    description: str
    note: str
    #: The results file under ``results/``, ``{setting}`` filled in.
    output: str


MODELS: dict[str, Workload] = {
    "gpt": Workload(
        build=gpt,
        blocks=lambda model: model.get_submodule("blocks"),
        description="examples GPT: 4 layers, d_model 256, 4 heads, vocab 8192, tied head",
        note=(
            "torch's ColwiseParallel splits the fused qkv projection by contiguous "
            "rows, lamina chunk by chunk (whole heads per rank): same FLOPs and bytes"
        ),
        output="tp_vs_torch_{setting}.json",
    ),
    "qwen3": Workload(
        build=qwen3,
        blocks=lambda model: model.get_submodule("model.layers"),
        description=(
            "transformers Qwen3ForCausalLM: 4 layers, hidden 256, 8 heads x 32 "
            "(grouped-query: 4 key/value heads), q/k RMSNorm per head, MLP 768 (SwiGLU), "
            "vocab 8192, untied head, sdpa attention, rotary positions"
        ),
        note=(
            "separate q/k/v projections: torch's ColwiseParallel on each gives every rank "
            "whole heads, as lamina's columns do (4 of 8 query heads, 2 of 4 key/value "
            "heads): the same heads, FLOPs and bytes. Both keep the embedding's output "
            "whole and slice the sequence entering model.layers.0 (HF computes the "
            "positions, rotary table and mask from the embedding's output)."
        ),
        output="tp_vs_torch_qwen3_{setting}.json",
    ),
}


LOSS_NOTE = (
    "lm_loss (F.cross_entropy) on HF's .logits inside lamina.loss_parallel / torch's "
    "loss_parallel, as on the GPT: HF's forward returns the head's vocabulary-split output "
    "untouched as .logits, so both loss parallelisms apply (checked against one process)"
)
#: Per-head norms (``*.q_norm``, ``*.k_norm``) -> the torch style ``torch_2d`` gave them
#: (``None``: none, a plain replicated parameter); filled by :func:`torch_2d`.
TORCH_HEAD_NORMS: dict[str, str | None] = {}
#: The per-head norms lamina's plan keeps whole with their gradients summed over tp.
LAMINA_HEAD_NORMS: list[str] = []


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a forward's output: the GPT's tensor, HF's ``.logits``."""
    logits: torch.Tensor = getattr(out, "logits", out)
    return logits


def batch(step: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets of ``step`` for data shard ``data_rank``."""
    gen = torch.Generator().manual_seed(step * 97 + data_rank)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def torch_2d(model: nn.Module, example: torch.Tensor, workload: Workload) -> nn.Module:
    """torch's 2-D: lamina's derived plan as ParallelStyles through ``parallelize_module``
    on the ``intra`` axis, then FSDP2 on ``inter``. The embedding's output stays whole
    and the sequence is sliced entering the first block, as lamina does (HF's models
    take positions from the embedding's output: sliced there, the layers would get a
    half-length rotary table)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    runtime = lamina.current()
    assert runtime is not None
    mesh = runtime.mesh.torch_mesh
    plan = derive_plan(model, (example,), None, mesh["intra"].size(), sequence_parallel=True)
    head = model.get_submodule(plan.heads[0].module)
    embedding = model.get_submodule(plan.embeddings[0].module)
    tied = head.weight is embedding.weight
    styles = torch_styles(plan)
    LAMINA_HEAD_NORMS[:] = [name for name, _dim in getattr(plan, "shared_modules", ())]
    for name, _ in model.named_modules():
        if name.endswith(("q_norm", "k_norm")):
            style = styles.get(name)
            TORCH_HEAD_NORMS[name] = None if style is None else repr(style)
    # torch's loss parallelism, as lamina's: the head's logits stay split by vocabulary
    styles[plan.heads[0].module] = ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    )
    parallelize_module(model, mesh["intra"], styles)
    if tied:  # parallelize_module gives the head and the embedding one weight each
        head.weight = embedding.weight
    for block in workload.blocks(model):
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


def wrap(variant: str, model: nn.Module, example: torch.Tensor, workload: Workload) -> nn.Module:
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
        return torch_2d(model, example, workload)
    return lamina.distribute(model, "hsdp")


def output_name(args: argparse.Namespace, setting: str) -> str:
    """The results file (in ``results/``) of this run."""
    return str(args.output or MODELS[args.model].output.format(setting=setting))


def model_fields(name: str, workload: Workload) -> dict[str, Any]:
    """The JSON's model fields: the GPT's as they always were, others by name with a
    description."""
    if name == "gpt":
        return {"model": workload.description}
    return {"model": name, "model_description": workload.description}


def extra_fields(name: str) -> dict[str, Any]:
    """What the JSON says of a model's particulars (the loss, per-head norms)."""
    if name != "qwen3":
        return {}
    norms = sorted(TORCH_HEAD_NORMS)
    if not norms:
        return {"loss": LOSS_NOTE, "loss_parallel": True}
    styled = [n for n in norms if TORCH_HEAD_NORMS[n] is not None]
    summed = [n for n in norms if n in LAMINA_HEAD_NORMS]
    if len(styled) == len(norms):
        torch_does = (
            f"torch_styles gives them {TORCH_HEAD_NORMS[norms[0]]}: the weight a replicated "
            "DTensor on tp, its input marked split by heads, so its gradient is Partial and "
            "DTensor all-reduces it over tp (the same sum as lamina's)"
        )
    elif not styled:
        torch_does = (
            "no style from torch_styles: plain replicated parameters, sharded by FSDP2 on "
            "inter only; each tp rank's gradient comes from its own heads and is never "
            "summed over tp, so the tp ranks' copies drift apart"
        )
    else:
        torch_does = f"styled: {styled}; the rest plain (gradients not summed over tp)"
    lamina_does = (
        "whole on every rank, gradients summed over tp (the plan's shared modules)"
        if len(summed) == len(norms)
        else f"summed over tp: {summed}; the rest whole, gradients not summed over tp"
    )
    return {
        "loss": LOSS_NOTE,
        "loss_parallel": True,
        "qk_norm": {
            "modules": len(norms),
            "lamina": lamina_does,
            "torch_2d": torch_does,
            "torch_styles": {n.split(".")[-1]: TORCH_HEAD_NORMS[n] for n in norms[:2]},
        },
    }


def run(args: argparse.Namespace, setting: str) -> None:
    """One rank's part: time the variants, interleaved; rank 0 writes the results. With
    ``--alone VARIANT``: that variant only, its process's peak RSS (``VmHWM``) written to
    ``--alone-out``."""
    torch.set_num_threads(1)
    workload = MODELS[args.model]
    runtime = lamina.init(mesh="topology")
    coords = runtime.mesh.coordinates()
    models: dict[str, nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    example = batch(0, 0)[0]
    variants = (args.alone,) if args.alone else VARIANTS
    for variant in variants:
        torch.manual_seed(0)
        models[variant] = wrap(variant, workload.build(), example, workload)
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
                    loss = lm_loss(logits_of(model(x)), y)
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
        lamina_model = models["lamina_tp_zero3"]
        plan = cast(ExecutionPlan, lamina_model.execution_plan)  # type: ignore[union-attr]
        write_results(
            "tp_vs_torch",
            output_name(args, setting),
            {
                "setting": setting,
                "link": args.emulate or "loopback",
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "steps_timed_per_variant": len(times[VARIANTS[0]]),
                **model_fields(args.model, workload),
                "batch": [BATCH, SEQ],
                "mesh": {"axes": list(runtime.mesh.axis_names), "ranks": runtime.mesh.ranks()},
                "median_step_s": step_s,
                "peak_rss_bytes": rss,
                **ratios,
                "lamina_strategy": plan.strategy,
                "lamina_layer_plan": dict(plan.meta).get("layer_plan", "").split("\n"),
                "sequence_parallel": True,
                "note": workload.note,
                **extra_fields(args.model),
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
            loss = lm_loss(logits_of(model(x)), y)
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
    results = RESULTS / output_name(args, setting)
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
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="gpt", help="the model (default: gpt)"
    )
    parser.add_argument(
        "--output",
        help="file name in benchmarks/results, or an absolute path (default: "
        "tp_vs_torch_<setting>.json for gpt, tp_vs_torch_qwen3_<setting>.json for qwen3)",
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
