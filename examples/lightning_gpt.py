"""Train the GPT example with Lightning Fabric on lamina's strategies.

The model of ``_gpt_model.py`` on the standard library's sources (``_stdlib_corpus.py``),
as ``train_gpt.py`` trains it, but the loop is Fabric's: ``fabric.setup``,
``fabric.backward``, ``fabric.clip_gradients``, ``fabric.save`` / ``fabric.load``. The
strategy is ``LaminaFabricStrategy`` (``lamina.integrations.lightning``); lamina's ranks
are started by ``lamina run`` or torchrun, never by Lightning:

    lamina run --nproc-per-node 2 examples/lightning_gpt.py --strategy zero3
    lamina run --nproc-per-node 4 examples/lightning_gpt.py --strategy tp_zero3 --mesh fsdp=2,tp=2

Each epoch shuffles the training windows (``DistributedSampler``, seed ``--seed``) over
the data replicas the strategy names (a tensor-parallel group shares one); with
``--checkpoint-dir`` a sharded checkpoint is saved every ``--save-every`` steps and
``--resume`` carries on from the latest one exactly. Rank 0 prints every step's loss.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lamina
from _gpt_model import GPT, GPTConfig, lm_loss
from _stdlib_corpus import CharCorpus, load_char_corpus, window_count
from lamina.integrations.lightning import LaminaFabricStrategy

T = TypeVar("T")

#: ``--strategy`` choices and the lamina strategies each distributes with.
STRATEGIES: dict[str, list[str]] = {
    "dp": ["dp"],
    "zero3": ["zero3"],
    "hsdp": ["hsdp"],
    "tp": ["tp"],
    "tp_zero3": ["tp", "zero3"],
    "tp_hsdp": ["tp", "hsdp"],
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options both Lightning examples share (model, data, optimizer, strategy)."""
    p.add_argument("--strategy", choices=tuple(STRATEGIES), default="zero3")
    p.add_argument(
        "--mesh",
        default=None,
        help="lamina.init's mesh: flat, topology or axis sizes such as fsdp=2,tp=2 "
        "(default: tp inside each node, the rest across nodes; hsdp the topology)",
    )
    p.add_argument("--max-steps", type=int, default=100, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--seq-len", type=int, default=128, help="characters per sequence")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--corpus-mb", type=float, default=2.0, help="cap on the corpus size")
    p.add_argument(
        "--windows", type=int, default=None, help="train on the first N windows only (an epoch)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--empty-init",
        action="store_true",
        help="build the model on the meta device: each rank allocates only its pieces",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults train in about a minute on two CPU cores."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_model_args(p)
    p.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here")
    p.add_argument("--save-every", type=int, default=50, help="steps between saves")
    p.add_argument(
        "--resume", action="store_true", help="carry on from the latest save in --checkpoint-dir"
    )
    p.add_argument("--resume-from", default=None, help="carry on from this saved step directory")
    args = p.parse_args(argv)
    if min(args.max_steps, args.batch_size, args.seq_len, args.save_every, args.accumulate) < 1:
        p.error("--max-steps, --batch-size, --seq-len, --save-every and --accumulate must be >= 1")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume loads from --checkpoint-dir: give one")
    return args


def parse_mesh(text: str | None) -> Any:
    """``--mesh``: None, ``flat``, ``topology`` or ``fsdp=2,tp=2`` as a dict."""
    if text is None or text in ("flat", "topology"):
        return text
    if not re.fullmatch(r"\w+=\d+(,\w+=\d+)*", text):
        raise SystemExit(f"--mesh {text!r}: give flat, topology or sizes such as fsdp=2,tp=2")
    return {axis: int(size) for axis, size in (part.split("=") for part in text.split(","))}


def model_config(args: argparse.Namespace, corpus: CharCorpus) -> GPTConfig:
    """The GPT's sizes from the options and the corpus's vocabulary."""
    return GPTConfig(corpus.vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads)


@torch.no_grad()
def init_gpt_weights(model: nn.Module) -> None:
    """The GPT's own initialization, for a model built on the meta device: each layer's
    ``reset_parameters()`` in construction order, then ``GPT.__init__``'s re-draws. From
    the same seed it gives the bits ``GPT(cfg)`` draws, on each rank's shards too."""
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    model.apply(GPT._init_weights)
    layers = len(model.blocks)  # type: ignore[arg-type]
    for name, param in model.named_parameters():
        if name.endswith(("attn.proj.weight", "mlp.2.weight")):
            nn.init.normal_(param, std=0.02 / math.sqrt(2 * layers))


class WindowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Window ``k`` of the token ids (``seq_len`` tokens from ``k * seq_len``) and the
    same shifted by one as its target."""

    def __init__(self, data: torch.Tensor, seq_len: int, count: int | None = None) -> None:
        self.data, self.seq_len = data, seq_len
        available = window_count(data, seq_len)
        self.count = available if count is None else min(count, available)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.data[k * self.seq_len : (k + 1) * self.seq_len + 1]
        return tokens[:-1], tokens[1:]


def make_loader(
    dataset: WindowDataset, batch_size: int, rank: int, replicas: int, seed: int
) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """Replica ``rank`` of ``replicas``' batches, shuffled per epoch (``set_epoch``) as
    the Lightning Trainer shuffles them."""
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def accumulation_groups(loader: Iterable[T], accumulate: int) -> Iterator[list[T]]:
    """An epoch's batches in groups of ``accumulate``, one optimizer step each (the last
    group may be shorter: the Lightning Trainer also steps at an epoch's last batch)."""
    group: list[T] = []
    for batch in loader:
        group.append(batch)
        if len(group) == accumulate:
            yield group
            group = []
    if group:
        yield group


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases and LayerNorm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def make_schedule(
    optimizer: torch.optim.Optimizer, args: argparse.Namespace
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``--warmup-steps``, then the peak rate."""
    warmup = max(1, args.warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))


def example_batch(args: argparse.Namespace) -> torch.Tensor:
    """A batch of the shape training feeds (tp derives its split from one forward)."""
    return torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)


def strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """``lamina.distribute`` options of ``--strategy`` (tp needs an example batch)."""
    if "tp" in STRATEGIES[args.strategy]:
        return {"example_inputs": (example_batch(args),)}
    return {}


def latest_checkpoint(directory: str) -> Path | None:
    """The newest ``step-<n>`` directory under ``directory``, or None."""
    found = [(int(p.name[5:]), p) for p in Path(directory).glob("step-*") if p.name[5:].isdigit()]
    return max(found)[1] if found else None


@dataclass
class Run:
    """What a run did: each step's loss on this rank, and the objects it trained."""

    losses: list[float] = field(default_factory=list)
    start: int = 0
    model: Any = None
    fabric: Any = None
    seconds: float = 0.0


def train(args: argparse.Namespace) -> Run:
    """Train under Fabric and return what happened (the job stays joined: ``main`` leaves
    it)."""
    strategy = LaminaFabricStrategy(
        STRATEGIES[args.strategy],
        mesh=parse_mesh(args.mesh),
        init_weights=init_gpt_weights,
        **strategy_options(args),
    )
    fabric = Fabric(strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)
    corpus = load_char_corpus(args.corpus_mb)
    with fabric.init_module(empty_init=args.empty_init):
        net = GPT(model_config(args, corpus))
    optimizer = make_optimizer(net, args)
    model, optimizer = fabric.setup(net, optimizer)
    schedule = make_schedule(optimizer, args)
    # this rank's share of the data: the strategy reads it off the distributed model
    # (model.data_replica: a tensor-parallel group shares one replica)
    replica = fabric.strategy.distributed_sampler_kwargs
    dataset = WindowDataset(corpus.train, args.seq_len, args.windows)
    loader = make_loader(
        dataset, args.batch_size, replica["rank"], replica["num_replicas"], args.seed
    )
    if len(loader) < 1:
        raise SystemExit("lightning_gpt: no full batch in the data; raise --corpus-mb or --windows")
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "schedule": schedule,
        "step": 0,
    }
    if args.resume or args.resume_from:
        found = (
            Path(args.resume_from) if args.resume_from else latest_checkpoint(args.checkpoint_dir)
        )
        if found is not None:
            fabric.load(found, state)
            fabric.print(f"lightning_gpt: resumed from {found} at step {state['step']}")
    run = Run(start=state["step"], model=model, fabric=fabric)
    fabric.print(
        f"lightning_gpt: {args.strategy} on {fabric.world_size} rank(s), "
        f"{replica['num_replicas']} data replica(s), {len(loader)} batches per epoch, "
        f"from step {run.start}"
    )
    started = time.perf_counter()
    step = run.start
    steps_per_epoch = math.ceil(len(loader) / args.accumulate)
    while step < args.max_steps:
        epoch, skip = divmod(step, steps_per_epoch)
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for k, group in enumerate(accumulation_groups(loader, args.accumulate)):
            if k < skip:  # resumed inside this epoch: its first steps were trained
                continue
            optimizer.zero_grad(set_to_none=True)
            for i, (x, y) in enumerate(group):
                x, y = fabric.to_device((x, y))
                # every micro-batch but a step's last accumulates locally (model.no_sync())
                with fabric.no_backward_sync(model, enabled=i < len(group) - 1):
                    loss = lm_loss(model(x), y)
                    fabric.backward(loss / args.accumulate)
                run.losses.append(float(loss.detach()))
            if args.grad_clip > 0:  # the whole model's norm: model.clip_grad_norm_
                fabric.clip_gradients(model, optimizer, max_norm=args.grad_clip)
            optimizer.step()
            schedule.step()
            step += 1
            fabric.print(f"step {step}/{args.max_steps} | loss {run.losses[-1]!r}")
            if args.checkpoint_dir and step % args.save_every == 0:
                state["step"] = step
                fabric.save(Path(args.checkpoint_dir) / f"step-{step}", state)
            if step >= args.max_steps:
                break
    run.seconds = time.perf_counter() - started
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Train; returns the process exit status."""
    args = parse_args(argv)
    try:
        run = train(args)
    except lamina.ConfigError as exc:
        print(f"lightning_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    if run.losses:
        run.fabric.print(
            f"done: {len(run.losses)} steps ({run.start + 1}-{args.max_steps}) | loss "
            f"{run.losses[0]:.4f} -> {run.losses[-1]:.4f} | {run.seconds:.1f} s"
        )
    lamina.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
