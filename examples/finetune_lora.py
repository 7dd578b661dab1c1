"""Fine-tune a Hugging Face Llama with LoRA (peft) on the Python standard library's sources.

An ordinary transformers + peft fine-tuning script plus two lamina calls: the same file
runs under every strategy, with accumulation, activation checkpointing and meta-device
initialization, and nothing in the loop changes between them:

    lamina run --nproc-per-node 2 examples/finetune_lora.py --strategy dp
    lamina run --nproc-per-node 2 examples/finetune_lora.py --strategy zero3 --meta-init \\
        --grad-accum 2 --gradient-checkpointing --output lora-out

Nothing is downloaded: the model is a ``LlamaForCausalLM`` built from a config (random
weights), or the ``save_pretrained`` folder given with ``--init-from``; the corpus is the
standard library's ``.py`` files, one token per character (``_stdlib_corpus.py``, as
``train_gpt.py`` reads it). LoRA adapters on ``q_proj`` and ``v_proj`` are the only
trained weights. ``--output`` saves the adapters with ``save_pretrained`` (and, when the
base was random, the base beside them in ``OUTPUT/base``) so that
``PeftModel.from_pretrained`` loads them back. Rank 0 prints the validation loss before
training, the train loss every ``--log-every`` steps and a final line with both losses
before -> after. Needs the examples extra: ``pip install "lamina-core[examples]"``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

import lamina
from _stdlib_corpus import CharCorpus, load_char_corpus, sample_batch, window_batch, window_count
from lamina import ConfigError, EpochSampler, seed_all

#: The modules LoRA adapts (the attention's query and value projections).
LORA_TARGETS = ("q_proj", "v_proj")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults train in about a minute on two CPU cores."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--strategy",
        choices=("dp", "zero3", "hsdp"),
        default="dp",
        help="hsdp shards inside each fast domain of the topology (LAMINA_TOPOLOGY declares one)",
    )
    p.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per microbatch")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="microbatches per optimizer step (dp: all but the last inside model.no_sync())",
    )
    p.add_argument("--lr", type=float, default=3e-2, help="AdamW learning rate of the adapters")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA scale numerator")
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from this save_pretrained folder (a Llama) instead of random weights",
    )
    p.add_argument("--hidden-size", type=int, default=256, help="random base only")
    p.add_argument("--layers", type=int, default=2, help="random base only")
    p.add_argument("--heads", type=int, default=4, help="random base only")
    p.add_argument("--kv-heads", type=int, default=2, help="random base only")
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each decoder layer in backward (the model's own method)",
    )
    p.add_argument(
        "--meta-init",
        action="store_true",
        help="build on the meta device, distribute, then materialize only each rank's "
        "shards (zero3/hsdp)",
    )
    p.add_argument("--output", default=None, metavar="DIR", help="save the adapters here")
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches per rank")
    p.add_argument("--corpus-mb", type=float, default=1.0, help="cap on the corpus size")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = (args.max_steps, args.batch_size, args.seq_len, args.grad_accum, args.log_every)
    if min(*sizes, args.lora_r, args.eval_batches) < 1:
        p.error(
            "--max-steps, --batch-size, --seq-len, --grad-accum, --log-every, --lora-r and "
            "--eval-batches must be >= 1"
        )
    if args.meta_init and args.strategy == "dp":
        p.error(
            "--meta-init materializes only each rank's shards, and dp keeps whole replicas: "
            "add --strategy zero3 or hsdp"
        )
    if args.init_from is not None and not (Path(args.init_from) / "config.json").is_file():
        p.error(
            f"--init-from {args.init_from}: no config.json there; give a save_pretrained folder"
        )
    return args


def base_config(args: argparse.Namespace, vocab_size: int) -> LlamaConfig:
    """The base model's config: the ``--init-from`` folder's, or one from the size flags.
    Token ids are the corpus's characters, so the vocabulary must hold them all."""
    if args.init_from is not None:
        config = LlamaConfig.from_pretrained(args.init_from)
        if config.vocab_size < vocab_size:
            raise SystemExit(
                f"finetune_lora: --init-from {args.init_from} has a vocabulary of "
                f"{config.vocab_size}, fewer than the corpus's {vocab_size} characters; "
                "lower --corpus-mb or start from a larger model"
            )
    else:
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=2 * args.hidden_size,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.seq_len,
        )
    config.use_cache = False  # training: no key/value cache
    return config


def build_model(args: argparse.Namespace, config: LlamaConfig) -> PeftModel:
    """The base Llama (from ``--init-from`` or random) with LoRA on ``LORA_TARGETS``.
    Under ``--meta-init`` the caller builds it inside ``torch.device("meta")``."""
    if args.init_from is not None and not args.meta_init:
        base = LlamaForCausalLM.from_pretrained(args.init_from, config=config)
    else:
        base = LlamaForCausalLM(config)
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=list(LORA_TARGETS))
    model: PeftModel = get_peft_model(base, lora)
    return model


def base_name(name: str) -> str:
    """A parameter's name in the base model's own checkpoint: without peft's prefix
    (``base_model.model.``) and LoRA's ``.base_layer`` level."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def initialize(model: nn.Module, args: argparse.Namespace, is_main: bool) -> None:
    """Fill a model that ``to_empty`` materialized: the base's own initializer (which
    also recomputes the rotary buffers), then with ``--init-from`` the checkpoint's
    weights (rank 0 reads them, ``set_model_state_dict`` hands each rank its shards),
    then LoRA's own initialization (B = 0: training starts from the base model)."""
    model.init_weights()  # type: ignore[operator]
    if args.init_from is not None:
        ours = {base_name(name): name for name in model.state_dict()}
        full: dict[str, torch.Tensor] = {}
        if is_main:
            for path in sorted(Path(args.init_from).glob("*.safetensors")):
                for name, tensor in load_file(path).items():
                    if name not in ours:
                        raise SystemExit(
                            f"finetune_lora: {path} holds {name!r}, which this Llama lacks; "
                            "give a LlamaForCausalLM checkpoint"
                        )
                    full[ours[name]] = tensor
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, full, options=options)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in module.lora_A:
                module.reset_lora_parameters(adapter, init_lora_weights=True)


def save_outputs(
    model: PeftModel, config: LlamaConfig, args: argparse.Namespace, is_main: bool
) -> Path:
    """Save the adapters to ``--output`` with the model's own ``save_pretrained`` (rank 0
    writes). zero3/hsdp hold shards: every rank calls it inside ``model.full_parameters()``,
    which gathers them (dp holds them whole). A random base is saved beside the adapters
    (``OUTPUT/base``) and named as their base model, so that ``PeftModel.from_pretrained``
    (or ``AutoPeftModelForCausalLM``) finds it."""
    output = Path(args.output)
    base_dir = Path(args.init_from) if args.init_from is not None else output / "base"
    sharded = args.strategy in ("zero3", "hsdp")
    with model.full_parameters() if sharded else nullcontext():  # type: ignore[operator]
        if args.init_from is None and is_main:
            trained = {name for name, p in model.named_parameters() if p.requires_grad}
            frozen = {
                base_name(name): tensor.detach().cpu().contiguous()
                for name, tensor in model.state_dict().items()
                if name not in trained
            }
            base_dir.mkdir(parents=True, exist_ok=True)
            config.save_pretrained(base_dir)
            save_file(frozen, str(base_dir / "model.safetensors"), metadata={"format": "pt"})
        if dist.is_initialized():  # peft's save_pretrained reads the base's config on every rank
            dist.barrier()
        model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
        model.save_pretrained(str(output), is_main_process=is_main)
    return output


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy (``y`` is ``x`` shifted by one)."""
    logits = model(input_ids=x).logits
    loss: torch.Tensor = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    return loss


def global_mean(value: float, count: int, device: torch.device) -> float:
    """Mean over all ranks of per-rank sums ``value`` of ``count`` items each."""
    totals = torch.tensor([value, float(count)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return float(totals[0] / totals[1].clamp(min=1.0))


@torch.no_grad()
def evaluate(
    model: nn.Module, corpus: CharCorpus, args: argparse.Namespace, rank: int, device: torch.device
) -> float:
    """Validation loss over ``--eval-batches`` fixed windows per rank (the same windows
    before and after training), averaged over all ranks."""
    generator = torch.Generator().manual_seed(args.seed + 1_000_003 * (rank + 1))
    model.eval()
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = sample_batch(corpus.val, args.batch_size, args.seq_len, generator)
        total += float(lm_loss(model, x.to(device), y.to(device)))
    model.train()
    return global_mean(total, args.eval_batches, device)


def main(argv: Sequence[str] | None = None) -> int:
    """Fine-tune; returns the process exit status."""
    args = parse_args(argv)
    with lamina.init(mesh="topology" if args.strategy == "hsdp" else "flat") as rt:
        started = time.perf_counter()
        seed_all(args.seed, rt.handle, rt.device)  # the same model and adapters everywhere
        corpus = load_char_corpus(args.corpus_mb)
        config = base_config(args, corpus.vocab_size)
        if args.meta_init:  # no memory yet: each rank materializes its shards after distribute
            with torch.device("meta"):
                net = build_model(args, config)
        else:
            net = build_model(args, config).to(rt.device)
        try:
            model = lamina.distribute(net, strategy=args.strategy)
        except ConfigError as exc:
            if rt.is_main:
                print(
                    f"finetune_lora.py: error: --strategy {args.strategy}: {exc}", file=sys.stderr
                )
            return 2
        if args.meta_init:
            model.to_empty(device=rt.device)
            initialize(model, args, rt.is_main)
        if args.gradient_checkpointing:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
        windows = window_count(corpus.train, args.seq_len)
        per_step = args.batch_size * args.grad_accum
        if windows < per_step * rt.world_size:
            raise SystemExit(
                f"finetune_lora: the corpus holds {windows} windows of {args.seq_len} "
                f"characters, fewer than one step's {per_step} x {rt.world_size} ranks; raise "
                "--corpus-mb or lower --batch-size / --grad-accum / --seq-len"
            )
        sampler = EpochSampler(
            windows, args.batch_size, rt.rank, rt.world_size, seed=args.seed, drop_last=True
        )
        n_total = sum(p.numel() for p in model.parameters())
        n_trained = sum(p.numel() for p in trained)
        tokens_per_step = per_step * args.seq_len * rt.world_size
        if rt.is_main:
            source = args.init_from or "random weights"
            print(
                f"model: LlamaForCausalLM ({source}), {n_total / 1e6:.2f}M params, "
                f"{n_trained:,} trained (LoRA r={args.lora_r} on {', '.join(LORA_TARGETS)}) | "
                f"corpus: {corpus.files} stdlib files, vocab {corpus.vocab_size} | "
                f"--strategy {args.strategy} on {rt.world_size} rank(s) ({rt.device}) | "
                f"{tokens_per_step:,} tokens/step",
                flush=True,
            )
        val_before = evaluate(model, corpus, args, rt.rank, rt.device)
        if rt.is_main:
            print(f"val loss before training {val_before:.4f}", flush=True)
        losses: list[float] = []
        window_sum, train_seconds = 0.0, 0.0
        for step in range(1, args.max_steps + 1):
            t0 = time.perf_counter()
            step_loss = 0.0
            for micro in range(args.grad_accum):
                x, y = window_batch(corpus.train, sampler.next_batch(), args.seq_len)
                last = micro == args.grad_accum - 1
                # dp defers its all-reduce to the last microbatch (DDP's pattern, from the
                # very first step); zero3/hsdp reduce-scatter each one into the shards
                deferred = model.no_sync() if args.strategy == "dp" and not last else nullcontext()
                with deferred:
                    loss = lm_loss(model, x.to(rt.device), y.to(rt.device)) / args.grad_accum
                    loss.backward()
                step_loss += float(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rt.handle.synchronize()
            train_seconds += time.perf_counter() - t0
            losses.append(step_loss)
            window_sum += step_loss
            if step % args.log_every == 0 or step == args.max_steps:
                count = (step - 1) % args.log_every + 1
                train_loss = global_mean(window_sum, count, rt.device)
                window_sum = 0.0
                if rt.is_main:
                    print(
                        f"step {step:>5}/{args.max_steps} | train loss {train_loss:.4f} | "
                        f"{tokens_per_step * step / train_seconds:,.0f} tok/s",
                        flush=True,
                    )
        val_after = evaluate(model, corpus, args, rt.rank, rt.device)
        saved = save_outputs(model, config, args, rt.is_main) if args.output else None
        if rt.is_main:
            where = f" | adapters saved to {saved}" if saved is not None else ""
            print(
                f"done: {args.max_steps} steps | train loss {losses[0]:.4f} -> {losses[-1]:.4f} | "
                f"val loss {val_before:.4f} -> {val_after:.4f} | "
                f"{tokens_per_step * len(losses) / train_seconds:,.0f} tok/s | "
                f"{time.perf_counter() - started:.1f} s{where}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
