"""``lamina.distribute(model, "auto")`` against every candidate it ranks, measured.

Each setting runs every candidate ``"auto"`` ranks (all that can run the model) for a
few steps, and ``"auto"``'s own choice, in one run, interleaved in rotating order
(medians of the slowest rank), and reports each candidate's predicted step time against
its measured one, and the auto choice's measured step against the best measured:

- ``loopback2``: 2 gloo ranks on this host, the flat mesh (dp, zero3, tp, pp);
- ``loopback4``: 4 gloo ranks on this host, a 2 x 2 mesh (``inter`` x ``intra``: dp,
  zero3, hsdp, tp(intra)+zero3(inter), pp(inter)+dp(intra), pp(inter)+zero3(intra));
- ``emulated-<link>``: 2 emulated hosts x 2 ranks joined by ``<link>`` (100, 200 and
  800 Mbit/s), the topology's ``inter`` x ``intra`` mesh (the same candidates).

Four models, the same global batch for every candidate (``b`` rows per rank under data
parallelism), AdamW:

- ``gpt``: the examples' GPT as ``train_gpt.py`` trains it (d 128, 4 layers, 128
  characters, ``b`` = 8);
- ``wide``: a wider one (d 512, 4 layers, 32 characters, ``b`` = 4) whose gradients
  outweigh its arithmetic;
- ``long``: a narrow GPT on long sequences (d 64, 2 layers, 1024 characters, ``b`` = 1),
  with context parallelism among the candidates (``context_min_tokens=1024``);
- ``moe``: transformers' Mixtral, small (d 64, 2 layers of 8 experts, top-2, 32 tokens,
  ``b`` = 4), with expert parallelism among the candidates.

Needs root for the emulated settings::

    python benchmarks/auto_choice.py                 # every setting -> results/auto_choice.json
    python benchmarks/auto_choice.py --settings loopback2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lamina
from _interleaved import torchrun_command
from _results import RESULTS, write_results
from emulated_training import INNER_ENV, run_emulated
from lamina.auto.candidates import Candidate
from lamina.auto.choose import distribute_candidate, replica_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig, lm_loss

SETTINGS = ("loopback2", "loopback4", "emulated-100mbit", "emulated-200mbit", "emulated-800mbit")
VOCAB = 96


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return MixtralForCausalLM(config)


@dataclass(frozen=True)
class BenchModel:
    """A model the benchmark runs: how to build it, its sequence, rows per rank and the
    options ``"auto"`` gets beside ``example_inputs``."""

    make: Callable[[], nn.Module]
    seq_len: int
    rows: int
    options: dict[str, Any] = field(default_factory=dict)


MODELS: dict[str, BenchModel] = {
    "gpt": BenchModel(lambda: GPT(GPTConfig(VOCAB, 128, 128, 4, 4)), 128, 8),
    "wide": BenchModel(lambda: GPT(GPTConfig(VOCAB, 32, 512, 4, 8)), 32, 4),
    "long": BenchModel(
        lambda: GPT(GPTConfig(VOCAB, 1024, 64, 2, 4)), 1024, 1, {"context_min_tokens": 1024}
    ),
    "moe": BenchModel(_mixtral, 32, 4),
}
#: The models a run takes by default (``long`` and ``moe``: ``--models`` them).
DEFAULT_MODELS = ("gpt", "wide")
SETTING_ENV = "LAMINA_AUTO_CHOICE_SETTING"


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name].make()


def loss_of(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """The next-token loss of a GPT's logits or a transformers model's output."""
    return lm_loss(getattr(out, "logits", out), targets)


def batch(step: int, replica: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 7919 + replica)
    idx = torch.randint(0, VOCAB, (rows, seq + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _rows(candidate: Candidate, per_rank: int) -> int:
    """Rows of one data replica's batch (a pipeline's, a tp group's, a rank's)."""
    return per_rank * candidate.world_size // candidate.data_replicas


def measure_model(runtime: lamina.Runtime, name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = MODELS[name]
    per_rank = spec.rows
    example = batch(0, runtime.rank, per_rank, spec.seq_len)[0]
    started = time.perf_counter()
    auto = lamina.distribute(build(name), "auto", example_inputs=(example,), **spec.options)
    auto_s = time.perf_counter() - started
    choice = auto.lamina_auto  # type: ignore[union-attr]
    ranking = choice.ranking
    variants: dict[str, tuple[Any, Candidate]] = {"auto": (auto, choice.candidate)}
    for entry in ranking.entries:
        if entry.prediction is None:
            continue
        model = distribute_candidate(lamina.distribute, build(name), entry.candidate, (example,))
        variants[entry.candidate.label] = (model, entry.candidate)
        if runtime.is_main:
            print(f"  {name}: built {entry.candidate.label}", flush=True)
    names = list(variants)
    optimizers = {v: torch.optim.AdamW(m.parameters(), lr=1e-4) for v, (m, _) in variants.items()}
    times: dict[str, list[float]] = {v: [] for v in names}
    # about a second of steps per variant and round (at least one, at most --steps)
    predicted = {e.candidate.label: e.prediction.step_s for e in ranking.entries if e.prediction}
    predicted["auto"] = predicted[choice.candidate.label]
    steps = {v: max(1, min(args.steps, int(1.0 / predicted[v]))) for v in names}
    step = 0
    for round_ in range(args.rounds + 1):  # round 0 warms up
        k = round_ % len(names)
        for variant in [*names[k:], *names[:k]]:
            model, candidate = variants[variant]
            replica = replica_of(runtime, candidate)[0]
            rows = _rows(candidate, per_rank)
            for _ in range(steps[variant]):
                step += 1
                x, y = batch(step, replica, rows, spec.seq_len)
                dist.barrier()
                start = time.perf_counter()
                if "pp" in candidate.strategies:
                    model.step(x, y, loss_of)
                else:
                    loss_of(model(x), y).backward()
                optimizers[variant].step()
                optimizers[variant].zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - start
                if round_ > 0:
                    times[variant].append(elapsed)
        if runtime.is_main:
            print(f"  {name}: round {round_}/{args.rounds} done", flush=True)
    medians = {v: statistics.median(t) for v, t in times.items()}
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, medians)
    measured = {v: max(g[v] for g in gathered) for v in names}
    rows_out = []
    for entry in ranking.entries:
        label = entry.candidate.label
        predicted = entry.prediction.step_s if entry.prediction else None
        got = measured.get(label)
        rows_out.append(
            {
                "candidate": label,
                "predicted_s": predicted,
                "measured_s": got,
                "error": (predicted / got - 1) if predicted and got else None,
                "predicted_memory_bytes": entry.prediction.memory_bytes
                if entry.prediction
                else None,
                "rejected": entry.rejected,
                "interval_s": list(entry.prediction.interval_s)
                if entry.prediction and entry.prediction.interval_s
                else None,
                "parts": entry.prediction.parts if entry.prediction else None,
            }
        )
    errors = [abs(r["error"]) for r in rows_out if r["error"] is not None]
    best = min((r for r in rows_out if r["measured_s"]), key=lambda r: r["measured_s"])
    result = {
        "model": name,
        "parameters": sum(p.numel() for p in build(name).parameters()),
        "rows_per_rank": per_rank,
        "auto_choice": choice.candidate.label,
        "auto_measured_s": measured["auto"],
        "best_measured": best["candidate"],
        "best_measured_s": best["measured_s"],
        "auto_over_best": measured["auto"] / best["measured_s"],
        "chosen_candidate_measured_s": measured[choice.candidate.label],
        "chosen_candidate_over_best": measured[choice.candidate.label] / best["measured_s"],
        "median_abs_error": statistics.median(errors) if errors else None,
        "auto_decision_s": auto_s,
        "candidates": rows_out,
        "profile": choice.profile.to_json(),
    }
    if runtime.is_main:
        _print_model(result)
    for model, _ in variants.values():
        del model
    return result


def _print_model(r: dict[str, Any]) -> None:
    print(
        f"\n{r['model']} ({r['parameters'] / 1e6:.2f}M parameters, "
        f"{r['rows_per_rank']} rows per rank)"
    )
    print(f"{'candidate':34}{'predicted ms':>14}{'measured ms':>13}{'error':>9}")
    for c in r["candidates"]:
        pred = f"{c['predicted_s'] * 1e3:14.1f}" if c["predicted_s"] else f"{'-':>14}"
        got = f"{c['measured_s'] * 1e3:13.1f}" if c["measured_s"] else f"{'-':>13}"
        err = f"{c['error']:+9.1%}" if c["error"] is not None else f"{'-':>9}"
        print(f"{c['candidate']:34}{pred}{got}{err}  {c['rejected']}")
    print(
        f"auto chose {r['auto_choice']}: measured {r['auto_measured_s'] * 1e3:.1f} ms = "
        f"{r['auto_over_best']:.3f}x the best measured ({r['best_measured']}; the chosen "
        f"candidate distributed by hand: {r['chosen_candidate_over_best']:.3f}x); median |error| "
        f"{r['median_abs_error']:.1%}; deciding took {r['auto_decision_s']:.1f} s",
        flush=True,
    )


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    setting = os.environ.get(SETTING_ENV, "loopback2")
    mesh: Any = {"inter": 2, "intra": 2} if setting == "loopback4" else "flat"
    if setting.startswith("emulated"):
        mesh = "topology"
    runtime = lamina.init(mesh=mesh)
    results = [measure_model(runtime, name, args) for name in args.models]
    if runtime.is_main:
        out = RESULTS / f"auto_choice.{setting}.part.json"
        out.write_text(
            json.dumps(
                {"setting": setting, "world_size": runtime.world_size, "models": results}, indent=2
            )
        )
    lamina.shutdown()


def _launch(setting: str, args: argparse.Namespace) -> int:
    argv = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--models", *args.models]
    env = {**os.environ, SETTING_ENV: setting}
    print(f"== {setting}", flush=True)
    if setting.startswith("emulated-"):
        os.environ[SETTING_ENV] = setting
        return run_emulated(setting.removeprefix("emulated-"), __file__, argv)
    cmd = torchrun_command(__file__, 2 if setting == "loopback2" else 4, argv)
    return subprocess.call(cmd, env={**env, INNER_ENV: "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="*", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--models", nargs="*", choices=tuple(MODELS), default=list(DEFAULT_MODELS))
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds after warm-up")
    parser.add_argument(
        "--steps", type=int, default=3, help="most steps per variant per round (~1 s of them)"
    )
    parser.add_argument(
        "--output", default="auto_choice.json", help="file name in benchmarks/results"
    )
    args = parser.parse_args()
    if os.environ.get(INNER_ENV):
        run(args)
        return
    settings = {}
    for setting in args.settings:
        part = RESULTS / f"auto_choice.{setting}.part.json"
        part.unlink(missing_ok=True)
        status = _launch(setting, args)
        if status != 0 or not part.is_file():
            sys.exit(f"auto_choice: setting {setting} failed (exit {status})")
        settings[setting] = json.loads(part.read_text())
        part.unlink()
    summary = []
    print(
        f"\n{'setting':18}{'model':7}{'auto':32}{'best measured':32}"
        f"{'auto/best':>10}{'med |err|':>10}"
    )
    for setting, data in settings.items():
        for m in data["models"]:
            summary.append(
                (
                    setting,
                    m["model"],
                    m["auto_choice"],
                    m["best_measured"],
                    m["auto_over_best"],
                    m["median_abs_error"],
                )
            )
            print(
                f"{setting:18}{m['model']:7}{m['auto_choice']:32}{m['best_measured']:32}{m['auto_over_best']:10.3f}{m['median_abs_error']:10.1%}"
            )
    previous = RESULTS / args.output
    merged = json.loads(previous.read_text())["settings"] if previous.is_file() else {}
    merged.update(settings)
    write_results(
        "auto_choice",
        args.output,
        {"rounds": args.rounds, "steps_per_round": args.steps, "settings": merged},
    )


if __name__ == "__main__":
    main()
