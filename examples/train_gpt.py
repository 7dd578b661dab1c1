"""Train a small character-level GPT on the Python standard library's own sources.

The corpus is on every machine with Python, so nothing is downloaded. The same file
runs on every lamina backend (cpu, cuda, xla, npu) with no edits:

    lamina run --nproc-per-node 2 examples/train_gpt.py --max-steps 30
    lamina run --nproc-per-node 8 --backend cuda examples/train_gpt.py --d-model 512

The training text is cut into windows of ``--seq-len`` tokens; each epoch shuffles them
(``lamina.EpochSampler``, seed ``--seed``) and every step each rank takes its
slice of the next global batch; ``lamina.distribute`` averages the gradients. A resumed
job carries on from the saved position in the epoch, on any number of ranks, so no
window is repeated or skipped. Rank 0 says where each attempt starts (fresh, or resumed
from which step directory, and how many steps are left), shows a progress bar, periodic
train/validation losses (averaged over all ranks) and a final summary line with the
number of steps this attempt ran. ``--seed`` seeds every random stream a checkpoint
records (``lamina.seed_all``), so two runs with one seed save the same bits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

import lamina
from _gpt_model import GPT, GPTConfig, lm_loss
from _stdlib_corpus import CharCorpus, load_char_corpus, sample_batch, window_batch, window_count
from lamina import CheckpointManager, ConfigError, EpochSampler, Fp8Codec, codecs, seed_all
from lamina.strategies.compiled.step import TrainingStep
from lamina.strategies.pp.compiled import PipelineCompiledStep


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults train in about a minute on two CPU cores."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--strategy",
        choices=("dp", "zero3", "hsdp", "pp", "auto"),
        default="dp",
        help="hsdp shards inside each fast domain of the topology (LAMINA_TOPOLOGY declares "
        "one); pp cuts the model into --pp stages, replicated over the other ranks; auto "
        "chooses among them (and tp) from predicted step time and memory, on the "
        "topology's hosts x ranks mesh, the global batch --batch-size x ranks",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="zero3: split each layer over this many ranks (tensor parallelism), the model "
        "sharded over the others (mesh fsdp x tp)",
    )
    p.add_argument("--pp", type=int, default=None, help="pp: pipeline stages (default: every rank)")
    p.add_argument(
        "--pp-schedule",
        default="1f1b",
        help="pp: gpipe, 1f1b, interleaved1f1b (2 stages per rank) or zbv (zero bubble)",
    )
    p.add_argument(
        "--pp-microbatches", type=int, default=4, help="pp: microbatches each batch is cut into"
    )
    p.add_argument(
        "--pp-shard",
        choices=("none", "zero3"),
        default="none",
        help="pp: zero3 shards each stage over the other ranks (pp x zero3) instead of "
        "replicating it",
    )
    p.add_argument(
        "--pp-tp",
        type=int,
        default=1,
        help="pp: tensor-parallel degree inside each stage (pp x tp; with --pp-shard zero3, 3-D)",
    )
    p.add_argument("--max-steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128, help="characters per sequence")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: max-steps / 10")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--eval-every", type=int, default=10, help="steps between loss reports")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches per rank")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="cap on the corpus size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save here every --checkpoint-every steps and at the end; resume from the "
        "latest complete checkpoint found here",
    )
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between saves")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints on a background thread while training goes on",
    )
    p.add_argument(
        "--kill-at-step",
        type=int,
        default=None,
        help="crash tests: rank --kill-rank SIGKILLs itself once after this step",
    )
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument(
        "--codec",
        default="none",
        help="dp: gradients on the wire in bf16/fp16, fp8 summed in two phases with (fp8) "
        "or without (fp8-no-feedback) error feedback, or a plugin's codec (lamina info "
        "lists them, e.g. int8)",
    )
    p.add_argument(
        "--codec-scope",
        choices=("all", "inter"),
        default="all",
        help="fp8 compresses every phase, or only the inter-host phase (hierarchical)",
    )
    p.add_argument(
        "--compile",
        choices=("none", "step"),
        default="none",
        help="step: the whole step (forward, loss, backward, the plan's collectives, "
        "clipping at --grad-clip, AdamW) as one captured graph (lamina.compile_step; dp, "
        "zero3, hsdp, and zero3 with --tp); under pp, each stage's blocks compiled",
    )
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of --compile step"
    )
    p.add_argument(
        "--metrics",
        default=None,
        help="rank 0 appends one JSON line per evaluation here (step, train and val loss)",
    )
    args = p.parse_args(argv)
    if min(args.max_steps, args.batch_size, args.seq_len, args.eval_every) < 1:
        p.error("--max-steps, --batch-size, --seq-len and --eval-every must be >= 1")
    if args.checkpoint_every < 1 or args.keep < 1:
        p.error("--checkpoint-every and --keep must be >= 1")
    if (args.codec != "none" or args.codec_scope != "all") and args.strategy != "dp":
        p.error("--codec and --codec-scope compress dp's buckets: add --strategy dp")
    if args.tp < 1 or (args.tp > 1 and args.strategy != "zero3"):
        p.error("--tp splits layers over ranks of a zero3 model: add --strategy zero3")
    if args.strategy == "pp" and args.compile != "none" and args.pp_tp != 1:
        p.error("--compile step compiles pp's stages without tp inside: drop --pp-tp")
    if args.strategy == "pp" and args.batch_size % args.pp_microbatches:
        p.error("--batch-size must be a multiple of --pp-microbatches")
    if (args.pp_shard != "none" or args.pp_tp != 1) and args.strategy != "pp":
        p.error("--pp-shard and --pp-tp split pipeline stages: add --strategy pp")
    known = [*OWN_CODECS, *codecs()]
    if args.codec not in known:
        p.error(f"--codec {args.codec!r} is unknown; use one of {', '.join(known)}")
    return args


#: What --codec accepts besides the codecs lamina knows by name (built-ins and plugins').
OWN_CODECS = ("none", "fp8-no-feedback")


def codec_options(args: argparse.Namespace) -> dict[str, object]:
    """``lamina.distribute`` options of ``--codec`` and ``--codec-scope`` (dp only)."""
    if args.codec == "none":
        return {}
    codec: object = args.codec
    if args.codec == "fp8-no-feedback":
        codec = Fp8Codec(error_feedback=False)
    return {"codec": codec, "codec_scope": args.codec_scope}


def write_metrics(path: str | None, record: dict[str, float]) -> None:
    """Append ``record`` to the ``--metrics`` file as one JSON line."""
    if path is not None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def kill_once(directory: str | None, step: int) -> None:
    """The crash tests' ``kill -9``: this rank dies here, once (a marker file next to the
    checkpoints keeps the restarted job alive)."""
    marker = Path(directory or ".") / f".killed-at-step-{step}"
    if not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def attempt_line(start: int, total: int, manager: CheckpointManager | None) -> str:
    """What this attempt starts from: ``train_gpt: resumed at step 6 of 8 from
    DIR/step-6: 2 steps to go`` or ``train_gpt: starting fresh at step 0 of 8: 8 steps to
    go`` (a job restarted by ``lamina run --max-restarts`` prints one per attempt)."""
    to_go = f"{total - start} steps to go"
    if manager is not None and manager.resumed_from is not None:
        return f"train_gpt: resumed at step {start} of {total} from {manager.resumed_from}: {to_go}"
    return f"train_gpt: starting fresh at step {start} of {total}: {to_go}"


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 (``step`` counts from 0)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases and LayerNorm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def init_mesh(args: argparse.Namespace) -> object:
    """The mesh the strategy runs on: HSDP the topology's inter x intra, pp its stages
    times the replicas, zero3 with --tp fsdp x tp, the others the flat one."""
    if args.strategy in ("hsdp", "auto"):
        return "topology"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp > 1:
        if world % args.tp:
            raise SystemExit(f"train_gpt: --tp {args.tp} must divide the {world} rank(s)")
        return {"fsdp": world // args.tp, "tp": args.tp}
    if args.strategy != "pp":
        return "flat"
    tp = args.pp_tp
    if tp < 1 or world % tp:
        raise SystemExit(f"train_gpt: --pp-tp {tp} must divide the {world} rank(s)")
    stages = args.pp or world // tp
    if stages < 2 or (world // tp) % stages:
        raise SystemExit(
            f"train_gpt: --strategy pp needs --pp of at least 2 dividing the {world // tp} "
            "rank(s) per tensor-parallel slice; start more ranks or give --pp"
        )
    replicas = world // (tp * stages)
    if args.pp_shard != "none" and replicas == 1:
        raise SystemExit(
            f"train_gpt: --pp-shard {args.pp_shard} shards each stage over the other ranks; "
            f"give --pp x --pp-tp below the {world} rank(s)"
        )
    axes = {"pp": stages, "dp": replicas, "tp": tp}
    return {axis: size for axis, size in axes.items() if size > 1 or axis == "pp"}


def pipelined(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs a pipeline schedule (``model.step``) rather than a forward."""
    return "lamina_pp" in model.__dict__


def global_mean(value: float, count: int, device: torch.device) -> float:
    """Mean over all ranks of per-rank sums ``value`` of ``count`` items each."""
    totals = torch.tensor([value, float(count)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return float(totals[0] / totals[1].clamp(min=1.0))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    corpus: CharCorpus,
    args: argparse.Namespace,
    rank: int,
    device: torch.device,
) -> float:
    """Validation loss over ``--eval-batches`` fixed windows per rank, averaged over ranks."""
    generator = torch.Generator().manual_seed(args.seed + 1_000_003 * (rank + 1))
    model.eval()
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = sample_batch(corpus.val, args.batch_size, args.seq_len, generator)
        if pipelined(model):  # every rank of the pipeline runs its stages
            total += float(model.evaluate(x.to(device), y.to(device), lm_loss))  # type: ignore[operator]
        else:
            total += float(lm_loss(model(x.to(device)), y.to(device)))
    model.train()
    return global_mean(total, args.eval_batches, device)


def main(argv: Sequence[str] | None = None) -> int:
    """Train; returns the process exit status."""
    args = parse_args(argv)
    # HSDP places itself on the topology's inter x intra mesh; the others on the flat one
    with lamina.init(mesh=init_mesh(args)) as rt:  # type: ignore[arg-type]
        started = time.perf_counter()
        # the same initial model on every rank, and every stream a checkpoint records
        # (torch's, the device's, Python's, NumPy's) seeded: two runs save the same states
        seed_all(args.seed, rt.handle, rt.device)
        corpus = load_char_corpus(args.corpus_mb)
        cfg = GPTConfig(
            corpus.vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads, args.dropout
        )
        net = GPT(cfg).to(rt.device)
        n_params = net.num_parameters()
        example = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device=rt.device)
        # dp plans its buckets from the captured graph (here at once, from an example)
        options: dict[str, object] = {}
        if args.strategy == "dp":
            options = {"example_inputs": (example,), **codec_options(args)}
        elif args.strategy == "auto":  # timed on one rank's batch: the global batch is its ranks'
            options = {"example_inputs": (example,)}
        elif args.strategy == "pp":
            options = {
                "example_inputs": (example,),
                "schedule": args.pp_schedule,
                "microbatches": args.pp_microbatches,
            }
        strategy: str | list[str] = args.strategy
        if args.tp > 1:  # layers split over the tp axis, sharded over fsdp
            strategy = ["tp", args.strategy]
            options = {"example_inputs": (example,)}
        if args.pp_tp > 1 or args.pp_shard != "none":
            # each stage's layers split over tp; its stages sharded over dp, gathered once
            # per step
            tp = ["tp"] if args.pp_tp > 1 else []
            shard = [args.pp_shard] if args.pp_shard != "none" else []
            strategy = [args.strategy, *tp, *shard]
        try:
            model = lamina.distribute(net, strategy=strategy, **options)
        except ConfigError as exc:
            if rt.is_main:
                print(f"train_gpt.py: error: --strategy {args.strategy}: {exc}", file=sys.stderr)
            return 2
        if rt.is_main and model.preflight is not None:  # type: ignore[union-attr]
            print(model.preflight.summary(), flush=True)  # type: ignore[union-attr]
        optimizer = make_optimizer(model, args)
        warmup = args.warmup_steps if args.warmup_steps is not None else args.max_steps // 10
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, max(1, warmup), args.max_steps)
        )
        compiled = (
            lamina.compile_step(
                model,
                optimizer,
                lm_loss,
                backend=args.compile_backend,
                max_norm=args.grad_clip if args.grad_clip > 0 else None,
            )
            if args.compile == "step"
            else None
        )
        windows = window_count(corpus.train, args.seq_len)
        # this rank's share of the data (a pipeline or a tp group shares one): the model
        # says, whatever the strategy
        replica, replicas = model.data_replica  # type: ignore[misc]
        if args.strategy == "auto":  # one replica's batch: the ranks' rows over the replicas
            args.batch_size = args.batch_size * rt.world_size // replicas
        if windows < args.batch_size * replicas:
            raise SystemExit(
                f"train_gpt: the corpus holds {windows} windows of {args.seq_len} tokens, "
                f"fewer than one step's {args.batch_size} x {replicas} replicas; raise "
                "--corpus-mb or lower --batch-size / --seq-len"
            )
        sampler = EpochSampler(
            windows, args.batch_size, replica, replicas, seed=args.seed, drop_last=True
        )
        manager = (
            CheckpointManager(args.checkpoint_dir, args.keep, async_save=args.async_save)
            if args.checkpoint_dir
            else None
        )
        start = 0
        if manager is not None:  # resume: weights, optimizer, schedule, RNG, data position
            start = manager.load_latest(model, optimizer, schedule) or 0
            if start and manager.extra is not None:  # on any number of ranks
                sampler.load_state_dict(manager.extra["data"])
        if rt.is_main:
            print(attempt_line(start, args.max_steps, manager), flush=True)
        tokens_per_step = args.batch_size * args.seq_len * replicas
        if rt.is_main:
            print(
                f"corpus: {corpus.files} stdlib files, {len(corpus.train):,} train / "
                f"{len(corpus.val):,} val chars, vocab {corpus.vocab_size} | model: "
                f"{n_params / 1e6:.2f}M params | {rt.world_size} rank(s) on "
                f"{rt.backend.name} ({rt.device}) | {tokens_per_step:,} tokens/step",
                flush=True,
            )
        losses: list[float] = []
        window_sum, window_n = 0.0, 0
        train_seconds, val_loss = 0.0, float("nan")
        progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"),
            TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TimeElapsedColumn(),
            disable=not rt.is_main,
        )
        with progress:
            task = progress.add_task("train", total=args.max_steps, loss=float("nan"), tps=0.0)
            rt.handle.synchronize()
            for step in range(start + 1, args.max_steps + 1):
                t0 = time.perf_counter()
                x, y = window_batch(corpus.train, sampler.next_batch(), args.seq_len)
                if compiled is not None:  # forward to the optimizer's update, one graph
                    loss = compiled(x.to(rt.device), y.to(rt.device))
                elif pipelined(model):  # the schedule runs the microbatches
                    optimizer.zero_grad(set_to_none=True)
                    loss = model.step(x.to(rt.device), y.to(rt.device), lm_loss)  # type: ignore[operator]
                    if args.grad_clip > 0:
                        model.clip_grad_norm_(args.grad_clip)  # type: ignore[operator]
                    optimizer.step()
                else:
                    loss = lm_loss(model(x.to(rt.device)), y.to(rt.device))
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if args.grad_clip > 0:
                        model.clip_grad_norm_(args.grad_clip)  # type: ignore[operator]
                    optimizer.step()
                schedule.step()
                rt.handle.synchronize()
                value = float(loss.detach())
                train_seconds += time.perf_counter() - t0
                losses.append(value)
                window_sum, window_n = window_sum + value, window_n + 1
                tps = tokens_per_step * (step - start) / train_seconds
                progress.update(task, completed=step, loss=value, tps=tps)
                if manager is not None and (
                    step % args.checkpoint_every == 0 or step == args.max_steps
                ):
                    extra = {"data": sampler.state_dict()}
                    manager.save(step, model, optimizer, schedule, extra)
                if step == args.kill_at_step and rt.rank == args.kill_rank:
                    kill_once(args.checkpoint_dir, step)
                if step == start + 1 and rt.is_main:
                    progress.console.print(
                        model.step_summary(),
                        markup=False,
                        highlight=False,
                        soft_wrap=True,  # type: ignore[operator]
                    )
                if step % args.eval_every == 0 or step == args.max_steps:
                    train_loss = global_mean(window_sum, window_n, rt.device)
                    val_loss = evaluate(model, corpus, args, replica, rt.device)
                    window_sum, window_n = 0.0, 0
                    if rt.is_main:
                        record = {"step": step, "train_loss": train_loss, "val_loss": val_loss}
                        write_metrics(args.metrics, record)
                        progress.console.print(
                            f"step {step:>5}/{args.max_steps} | train loss {train_loss:.4f} | "
                            f"val loss {val_loss:.4f} | {tps:,.0f} tok/s",
                            markup=False,
                            highlight=False,
                            soft_wrap=True,
                        )
        if manager is not None:
            manager.close()  # an async save still being written is committed first
        if rt.is_main and not losses:
            print(
                f"done: resumed at step {start} of {args.max_steps}: nothing left to train | "
                "this attempt ran 0 steps",
                flush=True,
            )
        elif rt.is_main:
            elapsed = time.perf_counter() - started
            print(
                f"done: {args.max_steps} steps | train loss {losses[0]:.4f} -> {losses[-1]:.4f}"
                f" | val loss {val_loss:.4f} | {tokens_per_step * len(losses) / train_seconds:,.0f}"
                f" tok/s | {elapsed:.1f} s | this attempt ran {len(losses)} steps "
                f"({start + 1}-{args.max_steps})",
                flush=True,
            )
        if rt.is_main and compiled is not None and losses:
            print(compiled_line(compiled), flush=True)
    return 0


def compiled_line(compiled: TrainingStep) -> str:
    """How ``--compile step`` ran: one graph (its compile seconds, the last gradient
    norm when clipping), each pipeline stage's blocks compiled, or eagerly with the
    reason."""
    if compiled.eager_reason:
        return f"compiled step: ran eagerly: {compiled.eager_reason}"
    seconds = sum(compiled.compile_seconds)
    norm = compiled.last_grad_norm
    if isinstance(compiled, PipelineCompiledStep):
        what, where = "each stage's blocks compiled (the schedule eager)", "after the schedule"
    else:
        what, where = "one graph per rank", "in it"
    clipped = "" if norm is None else f" | last gradient norm {float(norm):.3f} (clipped {where})"
    return f"compiled step: {what}, compiled in {seconds:.1f} s{clipped}"


if __name__ == "__main__":
    sys.exit(main())
