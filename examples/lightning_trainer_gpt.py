"""Train the GPT example with the Lightning Trainer on lamina's strategies.

A ``LightningModule`` holding the GPT of ``_gpt_model.py`` (``self.model``), trained by
``Trainer(strategy="lamina_zero3")`` (or ``LaminaTrainerStrategy(["tp", "zero3"],
mesh=...)``): the strategy distributes ``self.model`` with ``lamina.distribute``, clips
by the whole model's norm and saves sharded checkpoints that ``ckpt_path=`` resumes
exactly. The ranks are started by ``lamina run`` or torchrun, never by Lightning:

    lamina run --nproc-per-node 2 examples/lightning_trainer_gpt.py --strategy zero3
    lamina run --nproc-per-node 4 examples/lightning_trainer_gpt.py \\
        --strategy tp_zero3 --mesh fsdp=2,tp=2

The Trainer shuffles the training windows per epoch over the data replicas the strategy
names (a tensor-parallel group shares one). ``--checkpoint-dir`` saves a checkpoint every
``--save-every`` steps (``--windows`` sets an epoch's length: resume is exact from a save
that ends an epoch); ``--resume`` carries on from the latest. Rank 0 prints every
step's loss.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lamina
from _gpt_model import GPT, GPTConfig, lm_loss
from _stdlib_corpus import load_char_corpus
from lamina.integrations.lightning import LaminaTrainerStrategy
from lightning_gpt import (
    STRATEGIES,
    WindowDataset,
    add_model_args,
    example_batch,
    init_gpt_weights,
    make_optimizer,
    make_schedule,
    model_config,
    parse_mesh,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults train in about a minute on two CPU cores."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_model_args(p)
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here")
    p.add_argument(
        "--save-every",
        type=int,
        default=None,
        help="steps between saves (with --checkpoint-dir); resume is exact from a save that "
        "ends an epoch (Lightning restarts an epoch it resumes inside)",
    )
    p.add_argument(
        "--resume", action="store_true", help="carry on from the latest save in --checkpoint-dir"
    )
    p.add_argument("--resume-from", default=None, help="carry on from this checkpoint")
    args = p.parse_args(argv)
    if min(args.max_steps, args.batch_size, args.seq_len, args.accumulate) < 1:
        p.error("--max-steps, --batch-size, --seq-len and --accumulate must be >= 1")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume loads from --checkpoint-dir: give one")
    if args.checkpoint_dir and (args.save_every or 0) < 1:
        p.error("--checkpoint-dir saves every --save-every steps: give it (an epoch's steps)")
    return args


class GPTModule(pl.LightningModule):
    """The GPT as a LightningModule: ``self.model`` is what the strategy distributes;
    ``losses`` keeps each training step's loss on this rank."""

    def __init__(self, cfg: GPTConfig, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = GPT(cfg)
        self.losses: list[float] = []
        # a batch of the training shape: tensor parallelism derives its split from it
        self.example_input_array = example_batch(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The GPT's logits."""
        logits: torch.Tensor = self.model(x)
        return logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        """The batch's loss (kept in ``losses``; rank 0 prints it)."""
        x, y = batch
        loss = lm_loss(self.model(x), y)
        self.losses.append(float(loss.detach()))
        if self.trainer.is_global_zero:
            print(f"step {self.global_step + 1}/{self.args.max_steps} | loss {self.losses[-1]!r}")
        return loss

    def configure_optimizers(self) -> Any:
        """AdamW and the warm-up schedule, stepped every step."""
        optimizer = make_optimizer(self.model, self.args)
        schedule = make_schedule(optimizer, self.args)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def latest_checkpoint(directory: str) -> Path | None:
    """The checkpoint of the highest step under ``directory`` (``epoch=E-step=S.ckpt``)."""
    found = []
    for path in Path(directory).glob("*step=*"):
        step = path.name.rsplit("step=", 1)[1].split(".")[0]
        if step.isdigit():
            found.append((int(step), path))
    return max(found)[1] if found else None


def train(args: argparse.Namespace) -> tuple[GPTModule, pl.Trainer, float]:
    """Fit and return the module, the Trainer and the seconds fit took (the job stays
    joined: ``main`` leaves it)."""
    pl.seed_everything(args.seed, verbose=False)  # the model, and the samplers' shuffles
    corpus = load_char_corpus(args.corpus_mb)
    # tp's example batch is the LightningModule's example_input_array (no option needed)
    strategy = LaminaTrainerStrategy(
        STRATEGIES[args.strategy], mesh=parse_mesh(args.mesh), init_weights=init_gpt_weights
    )
    dataset = WindowDataset(corpus.train, args.seq_len, args.windows)
    callbacks = []
    if args.checkpoint_dir:
        # saved after the step that ends an epoch: Lightning 2.6 resumes a checkpoint of
        # on_train_epoch_end (ModelCheckpoint's default) with one extra batch, with its
        # own strategies too, and one saved inside an epoch restarts that epoch's data
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.checkpoint_dir, every_n_train_steps=args.save_every, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        strategy=strategy,
        max_steps=args.max_steps,
        gradient_clip_val=args.grad_clip if args.grad_clip > 0 else None,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        enable_checkpointing=bool(args.checkpoint_dir),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with trainer.init_module(empty_init=args.empty_init):
        module = GPTModule(model_config(args, corpus), args)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    ckpt: Path | None = None
    if args.resume_from:
        ckpt = Path(args.resume_from)
    elif args.resume:
        ckpt = latest_checkpoint(args.checkpoint_dir)
    started = time.perf_counter()
    trainer.fit(module, loader, ckpt_path=ckpt)
    return module, trainer, time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    """Train; returns the process exit status."""
    args = parse_args(argv)
    try:
        module, trainer, seconds = train(args)
    except lamina.ConfigError as exc:
        print(f"lightning_trainer_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    if trainer.is_global_zero and module.losses:
        print(
            f"done: {len(module.losses)} steps to step {trainer.global_step} | loss "
            f"{module.losses[0]:.4f} -> {module.losses[-1]:.4f} | {seconds:.1f} s"
        )
    lamina.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
