"""Lightning Fabric and the Lightning Trainer on lamina vs lamina's own loop: step time.

Two gloo ranks, one thread each (the script re-launches itself under torchrun), the GPT
of the examples (vocab 512, 128 tokens, d_model 128, 4 layers, 4 heads; 8 rows per rank
and step) under each of ``--strategies`` (default dp and zero3). The three variants run
the same step: forward, cross-entropy, backward, clipping at 1.0 through the model's
``clip_grad_norm_``, torch AdamW, batches from a DataLoader sharded by the model's data
replica:

- ``loop``: ``lamina.distribute`` and a plain loop;
- ``fabric``: ``Fabric(strategy=LaminaFabricStrategy(s))``, ``fabric.backward``,
  ``fabric.clip_gradients``;
- ``trainer``: ``Trainer(strategy=LaminaTrainerStrategy(s), gradient_clip_val=1.0)``, a
  LightningModule whose ``training_step`` returns the loss (no logging, no progress bar,
  no checkpoints); each block is one ``trainer.fit`` of ``--steps`` more steps.

A control case (``ddp``) runs the same three with Lightning's own DDP strategy and a torch
DDP loop: what Fabric's and the Trainer's loops cost per step without lamina (the Trainer
broadcasts a SIGTERM flag from rank 0 every step, a synchronization of the ranks the
loops do not have). ``--no-control`` skips it.

Each round runs a block of ``--steps`` steps of every variant, the order rotating (round
0 warms up). A step is timed from the end of one to the end of the next (for the Trainer
from one ``on_train_batch_end`` to the next: everything the Trainer does per step), so a
block's first step is not timed. The table reports the median step of the slowest rank,
the ratios to the loop, and the paired ratios (each round's blocks compared, the median
over rounds, the largest over the ranks); the JSON goes to
``results/lightning_overhead.json``::

    python benchmarks/lightning_overhead.py [--rounds 10] [--steps 8] [--strategies dp zero3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lamina
from _interleaved import relaunch_under_torchrun
from _results import write_results
from lamina.integrations.lightning import LaminaFabricStrategy, LaminaTrainerStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig, lm_loss

#: The model and batch (per rank).
VOCAB, SEQ, D_MODEL, LAYERS, HEADS, BATCH = 512, 128, 128, 4, 4, 8
LR, CLIP = 1e-3, 1.0
VARIANTS = ("loop", "fabric", "trainer")
#: The control case: Lightning's own DDP (Fabric, Trainer) against a torch DDP loop, which
#: shows what Lightning's loop costs per step without lamina.
CONTROL = "ddp"


def build() -> nn.Module:
    """The benchmark's GPT, the same random weights on every rank."""
    torch.manual_seed(0)
    return GPT(GPTConfig(VOCAB, SEQ, D_MODEL, LAYERS, HEADS))


def dataset(rows: int) -> TensorDataset:
    """Random token windows and the same shifted by one."""
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def loader(data: TensorDataset, index: int, count: int) -> DataLoader[Any]:
    """Replica ``index`` of ``count``'s batches, reshuffled every epoch."""
    sampler = DistributedSampler(data, num_replicas=count, rank=index, seed=0)
    return DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)


class Batches:
    """An endless stream of a loader's batches (``set_epoch`` at each epoch)."""

    def __init__(self, source: DataLoader[Any]) -> None:
        self.source, self.epoch = source, 0
        self.batches = iter(source)

    def next(self) -> Any:
        """The next batch, starting the next epoch when one ends."""
        try:
            return next(self.batches)
        except StopIteration:
            self.epoch += 1
            self.source.sampler.set_epoch(self.epoch)  # type: ignore[attr-defined]
            self.batches = iter(self.source)
            return next(self.batches)


class LoopVariant:
    """lamina's own loop: ``lamina.distribute``, AdamW, ``model.clip_grad_norm_`` (the
    control: torch DDP and ``torch.nn.utils.clip_grad_norm_``)."""

    def __init__(self, strategy: str, data: TensorDataset) -> None:
        if strategy == CONTROL:
            self.model: nn.Module = DDP(build())
            index, count = dist.get_rank(), dist.get_world_size()
        else:
            self.model = lamina.distribute(build(), strategy)
            index, count = self.model.data_replica  # type: ignore[misc]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.batches = Batches(loader(data, index, count))
        self.times: list[float] = []

    def block(self, steps: int, timed: bool) -> None:
        """``steps`` steps, each but the first timed when ``timed``."""
        last: float | None = None
        for _ in range(steps):
            x, y = self.batches.next()
            loss = lm_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if isinstance(self.model, DDP):
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            else:
                self.model.clip_grad_norm_(CLIP)  # type: ignore[operator]
            self.optimizer.step()
            now = time.perf_counter()
            if last is not None and timed:
                self.times.append(now - last)
            last = now


class FabricVariant:
    """Fabric on ``LaminaFabricStrategy``: the same loop in Fabric's calls."""

    def __init__(self, strategy: str, data: TensorDataset) -> None:
        self.fabric = Fabric(**lightning_strategy(strategy, LaminaFabricStrategy))
        self.fabric.launch()
        net = build()
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
        self.model, self.optimizer = self.fabric.setup(net, optimizer)
        replica = self.fabric.strategy.distributed_sampler_kwargs
        self.batches = Batches(loader(data, replica["rank"], replica["num_replicas"]))
        self.times: list[float] = []

    def block(self, steps: int, timed: bool) -> None:
        """``steps`` steps, each but the first timed when ``timed``."""
        last: float | None = None
        for _ in range(steps):
            x, y = self.batches.next()
            loss = lm_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            self.fabric.backward(loss)
            self.fabric.clip_gradients(self.model, self.optimizer, max_norm=CLIP)
            self.optimizer.step()
            now = time.perf_counter()
            if last is not None and timed:
                self.times.append(now - last)
            last = now


class GPTModule(pl.LightningModule):
    """The GPT as a LightningModule (``self.model`` is what the strategy distributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        """The batch's cross-entropy."""
        x, y = batch
        return lm_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        """AdamW on the network's parameters (made after the strategy distributed it)."""
        return torch.optim.AdamW(self.model.parameters(), lr=LR)


class StepTimer(pl.Callback):
    """The time from one ``on_train_batch_end`` to the next, while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """A ``fit`` starts: its first step is not timed."""
        self._last = None

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        """A step ended: the time since the last one."""
        now = time.perf_counter()
        if self._last is not None and self.active:
            self.times.append(now - self._last)
        self._last = now


class TrainerVariant:
    """The Trainer on ``LaminaTrainerStrategy``: each block one ``fit`` of ``steps`` more
    steps (the optimizer is configured again by each ``fit``, outside the timed steps)."""

    def __init__(self, strategy: str, data: TensorDataset) -> None:
        self.timer = StepTimer()
        self.trainer = pl.Trainer(
            **lightning_strategy(strategy, LaminaTrainerStrategy),
            max_steps=0,
            gradient_clip_val=CLIP,
            callbacks=[self.timer],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        self.module = GPTModule()
        self.data = data

    @property
    def times(self) -> list[float]:
        """The timed steps so far."""
        return self.timer.times

    def block(self, steps: int, timed: bool) -> None:
        """One ``fit`` of ``steps`` more steps, each but the first timed when ``timed``."""
        self.timer.active = timed
        self.trainer.fit_loop.epoch_loop.max_steps = self.trainer.global_step + steps
        # the Trainer shards the data itself (its DistributedSampler, the strategy's
        # distributed_sampler_kwargs)
        self.trainer.fit(self.module, DataLoader(self.data, batch_size=BATCH, shuffle=True))


Variant = LoopVariant | FabricVariant | TrainerVariant


def lightning_strategy(strategy: str, lamina_class: type[Any]) -> dict[str, Any]:
    """Fabric's or the Trainer's arguments for ``strategy``: lamina's class, or for the
    control Lightning's own DDP on this node's CPU ranks."""
    if strategy == CONTROL:
        return {"strategy": "ddp", "accelerator": "cpu", "devices": dist.get_world_size()}
    return {"strategy": lamina_class(strategy)}


def run_case(
    variants: dict[str, Variant], rounds: int, steps: int, label: str, main_rank: bool
) -> dict[str, Any]:
    """``rounds`` timed rounds (after one warm-up) of a block of each variant, the order
    rotating; the medians of the slowest rank and the paired ratios to the loop."""
    names = list(variants)
    for round_ in range(rounds + 1):  # round 0 warms up
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            variants[name].block(steps, timed=round_ > 0)
        if main_rank:
            print(f"  {label}: round {round_}/{rounds} done", flush=True)
    per_round = steps - 1

    def rounds_of(name: str) -> list[list[float]]:
        times = variants[name].times
        return [times[k : k + per_round] for k in range(0, len(times), per_round)]

    mine: dict[str, float] = {name: statistics.median(variants[name].times) for name in names}
    for name in ("fabric", "trainer"):
        pairs = zip(rounds_of(name), rounds_of("loop"), strict=True)
        mine[f"paired_{name}"] = statistics.median(
            statistics.median(a) / statistics.median(b) for a, b in pairs
        )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    slowest = {name: max(g[name] for g in gathered) for name in names}
    return {
        "median_step_s": slowest,
        "fabric_over_loop": slowest["fabric"] / slowest["loop"],
        "trainer_over_loop": slowest["trainer"] / slowest["loop"],
        "paired_fabric_over_loop": max(g["paired_fabric"] for g in gathered),
        "paired_trainer_over_loop": max(g["paired_trainer"] for g in gathered),
        "steps_timed_per_variant": len(variants["loop"].times),
    }


def main() -> None:
    """Time every strategy's three variants; print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=8, help="steps per variant per round")
    parser.add_argument("--strategies", nargs="*", default=["dp", "zero3"])
    parser.add_argument(
        "--no-control",
        action="store_true",
        help="skip the control: Lightning's own DDP against a torch DDP loop",
    )
    parser.add_argument("--output", default="lightning_overhead.json")
    args = parser.parse_args()
    relaunch_under_torchrun(__file__, nproc=2)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    runtime = lamina.init()
    data = dataset(64 * runtime.world_size * BATCH)
    results: dict[str, dict[str, Any]] = {}
    cases = [*args.strategies, *([] if args.no_control else [CONTROL])]
    for strategy in cases:
        variants: dict[str, Variant] = {
            "loop": LoopVariant(strategy, data),
            "fabric": FabricVariant(strategy, data),
            "trainer": TrainerVariant(strategy, data),
        }
        results[strategy] = run_case(variants, args.rounds, args.steps, strategy, runtime.is_main)
    if runtime.is_main:
        header = f"{'strategy':10}{'loop ms':>9}{'fabric ms':>11}{'trainer ms':>12}"
        print(header + f"{'fabric/loop':>13}{'trainer/loop':>14}{'paired F':>10}{'paired T':>10}")
        for strategy, r in results.items():
            t = r["median_step_s"]
            print(
                f"{strategy:10}{t['loop'] * 1e3:9.1f}{t['fabric'] * 1e3:11.1f}"
                f"{t['trainer'] * 1e3:12.1f}{r['fabric_over_loop']:13.3f}"
                f"{r['trainer_over_loop']:14.3f}{r['paired_fabric_over_loop']:10.3f}"
                f"{r['paired_trainer_over_loop']:10.3f}"
            )
        write_results(
            "lightning_overhead",
            args.output,
            {
                "world_size": runtime.world_size,
                "threads_per_rank": 1,
                "rounds": args.rounds,
                "steps_per_block": args.steps,
                "variants": list(VARIANTS),
                "model": (
                    f"GPT vocab {VOCAB}, d_model {D_MODEL}, {LAYERS} layers, {HEADS} heads; "
                    f"{BATCH} x {SEQ} tokens per rank and step; AdamW, clipping at {CLIP}"
                ),
                "results": results,
            },
        )
    lamina.shutdown()


if __name__ == "__main__":
    sys.exit(main())
