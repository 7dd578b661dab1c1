"""Train a Hugging Face Llama with ``transformers.Trainer`` on lamina's strategies.

An ordinary Trainer script (``TrainingArguments``, a dataset, ``trainer.train()``,
``trainer.save_model()``) with ``LaminaTrainer`` in place of ``Trainer``: lamina
distributes the model (``lamina.distribute``) where Accelerate would wrap it in DDP, and
the rest of the loop is Trainer's own (its optimizer, scheduler, clipping, accumulation,
logging and checkpoints):

    lamina run --nproc-per-node 2 examples/hf_trainer_llama.py --strategy zero3
    lamina run --nproc-per-node 4 examples/hf_trainer_llama.py --strategy tp_zero3 \\
        --mesh fsdp=2,tp=2
    lamina run --nproc-per-node 4 examples/hf_trainer_llama.py --parallelism dp_shard=2,tp=2
    lamina run --nproc-per-node 2 examples/hf_trainer_llama.py --strategy zero3 --resume

``--parallelism`` gives the sizes as Accelerate's ``ParallelismConfig`` does
(``TrainingArguments(parallelism_config=...)``, mapped onto lamina's mesh and strategies)
instead of lamina's ``--strategy`` / ``--mesh``. Every ``--save-steps`` steps a checkpoint
goes to ``--output-dir/checkpoint-N`` (the whole weights as ``save_pretrained`` writes
them, and lamina's sharded model, optimizer, scheduler and RNG state); ``--resume``
continues from the last one (or the one named) exactly. At the end the model is saved
whole to ``--output-dir/final``, which ``LlamaForCausalLM.from_pretrained`` loads.

Nothing is downloaded: the model is a ``LlamaForCausalLM`` built from a config (random
weights); the corpus is the standard library's ``.py`` files, one token per character
(``_stdlib_corpus.py``), cut into windows that Trainer shuffles each epoch. Rank 0 prints
every step's loss and a final line. Needs ``pip install "lamina-core[hf]"``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainingArguments,
)

from _stdlib_corpus import load_char_corpus, window_count
from lamina import ConfigError
from lamina.integrations.hf import LaminaTrainer

#: ``--strategy`` choices and the lamina strategies each distributes with.
STRATEGIES: dict[str, list[str]] = {
    "dp": ["dp"],
    "zero3": ["zero3"],
    "tp": ["tp"],
    "tp_zero3": ["tp", "zero3"],
}
#: ``--parallelism`` keys and the ``ParallelismConfig`` fields they set.
SIZES = {"dp_replicate": "dp_replicate_size", "dp_shard": "dp_shard_size", "tp": "tp_size"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults train in well under a minute on two CPU cores."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--strategy", choices=tuple(STRATEGIES), default=None, help="default: dp")
    p.add_argument(
        "--mesh",
        default=None,
        help="lamina.init's mesh as axis sizes, e.g. fsdp=2,tp=2 (default: flat; tp_zero3: "
        "tp=2 inside, fsdp the rest)",
    )
    p.add_argument(
        "--parallelism",
        default=None,
        metavar="SIZES",
        help="Accelerate ParallelismConfig sizes instead of --strategy/--mesh, e.g. "
        "dp_shard=2,tp=2 (keys: dp_replicate, dp_shard, tp)",
    )
    p.add_argument("--max-steps", type=int, default=40, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data replica")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--grad-accum", type=int, default=1, help="microbatches per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--corpus-mb", type=float, default=0.5, help="cap on the corpus size")
    p.add_argument("--output-dir", default="hf-trainer-llama", help="checkpoints and the model")
    p.add_argument("--save-steps", type=int, default=20, help="steps between checkpoints")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CHECKPOINT",
        help="continue from the last checkpoint in --output-dir (or the one named)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = (args.max_steps, args.batch_size, args.seq_len, args.grad_accum, args.save_steps)
    if min(sizes) < 1:
        p.error("--max-steps, --batch-size, --seq-len, --grad-accum and --save-steps must be >= 1")
    if args.parallelism is not None and (args.strategy is not None or args.mesh is not None):
        p.error("--parallelism gives the sizes Accelerate's way: drop --strategy and --mesh")
    return args


def axis_sizes(text: str, what: str, allowed: Sequence[str] | None = None) -> dict[str, int]:
    """``fsdp=2,tp=2`` as ``{"fsdp": 2, "tp": 2}``; SystemExit naming a malformed item."""
    sizes: dict[str, int] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not value.isdigit() or (allowed is not None and name not in allowed):
            keys = f" (keys: {', '.join(allowed)})" if allowed is not None else ""
            raise SystemExit(f"hf_trainer_llama: {what} item {item!r}: give NAME=SIZE{keys}")
        sizes[name] = int(value)
    return sizes


class Windows(Dataset[dict[str, torch.Tensor]]):
    """The corpus cut into windows of ``seq_len`` characters; the labels are the inputs
    (the model shifts them)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.count = window_count(data, seq_len)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.data[index * self.seq_len : (index + 1) * self.seq_len]
        return {"input_ids": window, "labels": window}


class PrintLosses(TrainerCallback):
    """Rank 0 prints each logged step's loss (9 significant digits: float32 exactly)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if logs is None or "loss" not in logs:
            return
        self.losses.append(float(logs["loss"]))
        if state.is_world_process_zero:
            print(
                f"step {state.global_step:>4}/{state.max_steps} | loss {logs['loss']:.9g} | "
                f"grad norm {float(logs.get('grad_norm', 0.0)):.4f}",
                flush=True,
            )


def distribution(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """``LaminaTrainer``'s keyword arguments for ``--strategy`` / ``--mesh`` (the
    ``--parallelism`` form goes through ``TrainingArguments`` instead)."""
    if args.parallelism is not None:
        return {}
    strategy = STRATEGIES[args.strategy or "dp"]
    mesh: dict[str, int] | None = None
    if args.mesh is not None:
        mesh = axis_sizes(args.mesh, "--mesh")
    elif strategy == ["tp", "zero3"]:
        mesh = {"fsdp": max(1, world // 2), "tp": min(2, world)}
    return {"strategy": strategy if len(strategy) > 1 else strategy[0], "mesh": mesh}


def main(argv: Sequence[str] | None = None) -> int:
    """Train; returns the process exit status."""
    args = parse_args(argv)
    started = time.perf_counter()
    corpus = load_char_corpus(args.corpus_mb)
    parallelism = None
    if args.parallelism is not None:
        from accelerate import ParallelismConfig

        given = axis_sizes(args.parallelism, "--parallelism", tuple(SIZES))
        parallelism = ParallelismConfig(**{SIZES[k]: v for k, v in given.items()})
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        weight_decay=0.0,
        warmup_steps=max(1, args.max_steps // 10),
        logging_steps=1,
        save_steps=args.save_steps,
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        parallelism_config=parallelism,
        # Accelerate runs CPU ranks as a distributed job only when told they are CPU ranks
        use_cpu=not torch.accelerator.is_available(),
    )
    config = LlamaConfig(
        vocab_size=corpus.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        use_cache=False,
    )
    torch.manual_seed(args.seed)  # the same random weights on every rank
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    losses = PrintLosses()
    try:
        trainer = LaminaTrainer(
            model=model,
            args=training,
            train_dataset=Windows(corpus.train, args.seq_len),
            callbacks=[losses],
            **distribution(args, training.world_size),
        )
    except ConfigError as exc:
        if training.process_index == 0:
            print(f"hf_trainer_llama.py: error: {exc}", file=sys.stderr)
        return 2
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    main_process = trainer.is_world_process_zero()
    if main_process:
        plan = trainer.lamina_plan
        print(
            f"model: LlamaForCausalLM (random weights), {params:,} parameters, vocab "
            f"{corpus.vocab_size} | {plan.describe()} on {training.world_size} rank(s) "
            f"({training.device}) | {training.world_size // trainer.get_tp_size()} data "
            "replica(s)",
            flush=True,
        )
    trainer.train(resume_from_checkpoint=args.resume)
    final = Path(args.output_dir) / "final"
    trainer.save_model(str(final))
    if main_process:
        ran = f"{losses.losses[0]:.4f} -> {losses.losses[-1]:.4f}" if losses.losses else "none"
        print(
            f"done: step {trainer.state.global_step} | loss {ran} | saved to {final} | "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
