"""LaminaTrainer (``transformers.Trainer`` on lamina) vs lamina's own loop: step time.

Two gloo ranks, one thread each (the script re-launches itself under torchrun), the same
transformers Llama built from a config (hidden 128, 4 layers, 4 heads / 2 key-value heads,
vocab 2048, 128 tokens, 4 rows per rank and step) under each of ``--strategies`` (default
dp and zero3). Both variants run the same step: forward with the labels, backward,
clipping at 1.0 (the model's ``clip_grad_norm_``), torch AdamW (Trainer's ``adamw_torch``),
the linear schedule, batches from a DataLoader sharded by ``model.data_replica``. A
control case runs plain ``Trainer`` (Accelerate's DDP) against a torch DDP loop, which
shows what Trainer's own loop costs per step without lamina (``--no-control`` skips it).

Each round runs a block of ``--steps`` steps of both variants, the order alternating
(round 0 warms up). The Trainer's block is one ``trainer.train()`` of ``--steps`` steps; a
step is timed from one ``on_step_end`` to the next, so it holds everything Trainer does
per step (its data loader, the token count it all-gathers for the loss scale, the loss
bookkeeping, callbacks); the loop's step is timed over the same span of its iteration.
The table reports the median step of the slowest rank, their ratio, and the paired
ratio (each round's two blocks compared, the median over rounds, the largest over the
ranks); the JSON goes to ``results/hf_trainer_overhead.json``::

    python benchmarks/hf_trainer_overhead.py [--rounds 10] [--steps 6] [--strategies dp zero3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

import lamina
from _interleaved import relaunch_under_torchrun
from _results import write_results
from lamina.integrations.hf import LaminaTrainer

#: The model and batch (per rank).
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, SEQ, BATCH = 2048, 128, 4, 4, 2, 128, 4
LR = 1e-3


def build() -> LlamaForCausalLM:
    """The benchmark's Llama, the same random weights on every rank."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def rows(count: int) -> list[dict[str, torch.Tensor]]:
    """Random token rows, the labels the inputs (the model shifts them)."""
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row} for row in ids]


class StepTimer(TrainerCallback):
    """The time from one ``on_step_end`` to the next, while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self._last = None

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        now = time.perf_counter()
        if self._last is not None and self.active:
            self.times.append(now - self._last)
        self._last = now


class TrainerVariant:
    """A Trainer (``LaminaTrainer`` with ``strategy``, or plain ``Trainer``: Accelerate's
    DDP) whose ``train()`` runs one block of ``steps`` steps."""

    def __init__(
        self, data: list[dict[str, torch.Tensor]], steps: int, out: Path, strategy: str | None
    ) -> None:
        args = TrainingArguments(
            output_dir=str(out / (strategy or "ddp")),
            per_device_train_batch_size=BATCH,
            max_steps=steps,
            learning_rate=LR,
            optim="adamw_torch",
            logging_steps=10**6,  # logs at the end of train() only, outside the timed steps
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=not torch.accelerator.is_available(),
            seed=0,
            log_level="error",
            # the DDP loop's setting (Trainer's default walks the graph for unused ones)
            ddp_find_unused_parameters=False,
        )
        self.timer = StepTimer()
        common: dict[str, Any] = {"model": build(), "args": args, "train_dataset": data}
        if strategy is None:
            self.trainer = Trainer(callbacks=[self.timer], **common)
        else:
            self.trainer = LaminaTrainer(callbacks=[self.timer], strategy=strategy, **common)
        self.trainer.remove_callback(PrinterCallback)

    @property
    def times(self) -> list[float]:
        return self.timer.times

    def block(self, steps: int, timed: bool) -> None:
        self.timer.active = timed
        self.trainer.train()


class LoopVariant:
    """A plain loop: the model ``wrap`` gives (lamina's or torch DDP), AdamW, the linear
    schedule, clipping at 1.0, batches from a DataLoader over this rank's data replica."""

    def __init__(self, wrap: str, data: list[dict[str, torch.Tensor]], total: int) -> None:
        if wrap == "ddp":
            self.model: nn.Module = DDP(build())
            index, count = dist.get_rank(), dist.get_world_size()
        else:
            self.model = lamina.distribute(build(), wrap)
            index, count = self.model.data_replica  # type: ignore[misc]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.schedule = get_linear_schedule_with_warmup(self.optimizer, 0, total)
        sampler = DistributedSampler(data, num_replicas=count, rank=index, seed=0)  # type: ignore[arg-type]
        self.loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)  # type: ignore[arg-type]
        self.epoch, self.batches = 0, iter(self.loader)
        self.times: list[float] = []

    def next_batch(self) -> dict[str, torch.Tensor]:
        try:
            batch: dict[str, torch.Tensor] = next(self.batches)
        except StopIteration:
            self.epoch += 1
            self.loader.sampler.set_epoch(self.epoch)  # type: ignore[attr-defined]
            self.batches = iter(self.loader)
            batch = next(self.batches)
        return batch

    def clip(self) -> None:
        if isinstance(self.model, DDP):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        else:
            self.model.clip_grad_norm_(1.0)  # type: ignore[operator]

    def block(self, steps: int, timed: bool) -> None:
        last: float | None = None
        for _ in range(steps):
            batch = self.next_batch()
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            loss.backward()
            self.clip()
            self.optimizer.step()
            self.schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
            now = time.perf_counter()
            if last is not None and timed:
                self.times.append(now - last)
            last = now


Variant = TrainerVariant | LoopVariant


def run_case(
    variants: dict[str, Variant], rounds: int, steps: int, label: str, main_rank: bool
) -> dict[str, Any]:
    """``rounds`` timed rounds (after one warm-up) of a block of each variant, the order
    alternating; the medians of the slowest rank and the paired ratio (each round's two
    blocks compared, the median over rounds, the largest over the ranks)."""
    trainer, loop = variants["trainer"], variants["loop"]
    for round_ in range(rounds + 1):  # round 0 warms up
        order = (trainer, loop) if round_ % 2 == 0 else (loop, trainer)
        for variant in order:
            dist.barrier()
            variant.block(steps, timed=round_ > 0)
        if main_rank:
            print(f"  {label}: round {round_}/{rounds} done", flush=True)
    per_round = steps - 1
    pairs = zip(
        (trainer.times[k : k + per_round] for k in range(0, len(trainer.times), per_round)),
        (loop.times[k : k + per_round] for k in range(0, len(loop.times), per_round)),
        strict=True,
    )
    mine = {
        "trainer": statistics.median(trainer.times),
        "loop": statistics.median(loop.times),
        "paired": statistics.median(
            statistics.median(t) / statistics.median(lo) for t, lo in pairs
        ),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    slowest = {v: max(g[v] for g in gathered) for v in ("trainer", "loop")}
    return {
        "median_step_s": slowest,
        "trainer_over_loop": slowest["trainer"] / slowest["loop"],
        "paired_trainer_over_loop": max(g["paired"] for g in gathered),
        "steps_timed_per_variant": len(loop.times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=6, help="steps per variant per round")
    parser.add_argument("--strategies", nargs="*", default=["dp", "zero3"])
    parser.add_argument(
        "--no-control",
        action="store_true",
        help="skip the control: plain Trainer (Accelerate's DDP) against a torch DDP loop",
    )
    parser.add_argument("--output", default="hf_trainer_overhead.json")
    args = parser.parse_args()
    relaunch_under_torchrun(__file__, nproc=2)
    torch.set_num_threads(1)
    runtime = lamina.init()
    data = rows(64 * runtime.world_size * BATCH)
    out = Path(tempfile.mkdtemp(prefix="hf_trainer_overhead_"))  # Trainer's output_dir: unused
    total = (args.rounds + 1) * args.steps
    cases: list[tuple[str, str | None, str]] = [(s, s, s) for s in args.strategies]
    if not args.no_control:
        cases.append(("ddp (control)", None, "ddp"))
    results: dict[str, dict[str, Any]] = {}
    for label, strategy, wrap in cases:
        variants: dict[str, Variant] = {
            "trainer": TrainerVariant(data, args.steps, out, strategy),
            "loop": LoopVariant(wrap, data, total),
        }
        results[label] = run_case(variants, args.rounds, args.steps, label, runtime.is_main)
    if runtime.is_main:
        print(f"{'case':15}{'trainer ms':>12}{'loop ms':>10}{'trainer/loop':>14}{'paired':>9}")
        for label, r in results.items():
            t = r["median_step_s"]
            print(
                f"{label:15}{t['trainer'] * 1e3:12.1f}{t['loop'] * 1e3:10.1f}"
                f"{r['trainer_over_loop']:14.3f}{r['paired_trainer_over_loop']:9.3f}"
            )
        model = (
            f"LlamaForCausalLM vocab {VOCAB}, hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads "
            f"/ {KV_HEADS} kv heads; {BATCH} x {SEQ} tokens per rank and step"
        )
        write_results(
            "hf_trainer_overhead",
            args.output,
            {
                "world_size": runtime.world_size,
                "threads_per_rank": 1,
                "rounds": args.rounds,
                "steps_per_block": args.steps,
                "model": model,
                "cases": {
                    label: {"trainer": "LaminaTrainer" if s else "Trainer (DDP)", "loop": w}
                    for label, s, w in cases
                },
                "results": results,
            },
        )
    lamina.shutdown()


if __name__ == "__main__":
    sys.exit(main())
