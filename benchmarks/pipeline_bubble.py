"""Each pipeline schedule's measured bubble against its formula, on ranks that each own a
core.

The emulated cluster of ``emulated_pipeline.py`` runs 4 ranks on this machine's 2 cores,
so a rank's forward slows whenever the rank sharing its core computes, and its bubble
(the schedule's time it spends outside its stages' chunks) mixes the schedule's idle
time with waiting for the core. Here 2 ranks on loopback (one pipeline of 2 stages, one
thread each, one core each) run the examples' GPT at width 512 with 8 blocks and a small
vocabulary (256: the head and loss, charged to the last stage, weigh little, so the
measured cut balances the stages as the formula assumes), 16 sequences of 128 per step
in ``--microbatches`` microbatches, under every schedule, interleaved in rotating order
(round 0 warms up). Reported per schedule: the bubble measured on each rank (median over
the steps of ``model.lamina_pp.engine.last_phases.bubble``) and their mean, the
schedule's formula (``lamina.strategies.pp.schedules.bubble_fraction``), and the
simulator's (``lamina.simulate.predict`` on the plan, on this machine's loopback), and
the idle time beyond the formula per schedule action (forward, backward, and ZBV's
weight gradient, on each of the rank's stages for each microbatch), which the formula
counts as zero: the schedule's own work and each transfer's latency, beside the
measured one-way time of one activation between the two ranks::

    python benchmarks/pipeline_bubble.py     # re-launches under torchrun, 2 ranks
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lamina
from _interleaved import relaunch_under_torchrun
from _results import write_results
from lamina.strategies.pp.schedules import bubble_fraction, schedule_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig, lm_loss

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv")
VOCAB, SEQ, WIDTH, LAYERS, HEADS, BATCH = 256, 128, 512, 8, 8, 16


def build() -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=WIDTH, n_layers=LAYERS, n_heads=HEADS)
    return GPT(config)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _simulated_bubble(model: Any) -> float:
    """The simulator's bubble for the plan on a loopback pair (one host, two devices)."""
    from lamina.simulate import cluster_from_dict, predict

    cluster = cluster_from_dict(
        {
            "hosts": 1,
            "devices_per_host": 2,
            "intra": {"bandwidth_gbps": 20.0, "latency_us": 50.0},
            "mesh": {"pp": 2},
        },
        "this machine's loopback",
    )
    prediction = predict(model.execution_plan, cluster)
    assert prediction.pipeline is not None
    return float(prediction.pipeline.bubble)


def _transfer_ms(nbytes: int, reps: int = 30) -> float:
    """Median one-way time of one activation between the two ranks (half a ping-pong
    of ``nbytes``), in ms: what each send/recv pair of the schedule costs at the least."""
    buffer = torch.zeros(nbytes // 4)
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        started = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        times.append((time.perf_counter() - started) / 2)
    return statistics.median(times[1:]) * 1e3


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    runtime = lamina.init(mesh={"pp": 2})
    example = batch(0)[0]
    activation = BATCH // args.microbatches * SEQ * WIDTH * 4  # fp32 per microbatch
    transfer_ms = _transfer_ms(activation)
    models = {
        name: lamina.distribute(
            build(),
            "pp",
            example_inputs=(example,),
            schedule=name,
            microbatches=args.microbatches,
        )
        for name in SCHEDULES
    }
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
    bubbles: dict[str, list[float]] = {n: [] for n in SCHEDULES}
    steps_s: dict[str, list[float]] = {n: [] for n in SCHEDULES}
    step = 0
    for round_ in range(args.rounds + 1):  # round 0 warms up
        k = round_ % len(SCHEDULES)
        for name in [*SCHEDULES[k:], *SCHEDULES[:k]]:
            for _ in range(args.steps):
                step += 1
                x, y = batch(step)
                dist.barrier()
                started = time.perf_counter()
                models[name].step(x, y, lm_loss)  # type: ignore[operator]
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - started
                if round_ > 0:
                    bubbles[name].append(models[name].lamina_pp.engine.last_phases.bubble)
                    steps_s[name].append(elapsed)
        if runtime.is_main:
            print(f"  round {round_}/{args.rounds} done", flush=True)
    mine = {n: statistics.median(b) for n, b in bubbles.items()}
    step_median = {n: statistics.median(s) for n, s in steps_s.items()}
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, (mine, step_median))
    if runtime.is_main:
        _report(args, gathered, models, activation, transfer_ms)
    lamina.shutdown()


def _report(
    args: argparse.Namespace,
    gathered: list[Any],
    models: dict[str, Any],
    activation: int,
    transfer_ms: float,
) -> None:
    rows: dict[str, dict[str, Any]] = {}
    print(f"one activation ({activation:,} B) between the ranks: {transfer_ms:.2f} ms one way")
    print(f"{'schedule':<16} {'measured':>9} {'per rank':>15} {'formula':>8} {'off':>7} "
          f"{'simulated':>9} {'step ms':>8} {'ms/action':>9}")  # fmt: skip
    for name in SCHEDULES:
        per_rank = [g[0][name] for g in gathered]
        measured = statistics.mean(per_rank)
        kind = schedule_kind(name)
        formula = bubble_fraction(kind, 2, args.microbatches, 2)
        simulated = _simulated_bubble(models[name])
        step_s = max(g[1][name] for g in gathered)
        # the schedule's actions on one rank: forward and backward of each microbatch on
        # each of its stages (ZBV: the backward split into input and weight gradients)
        stages_per_rank = kind.stages_per_rank(2)
        actions = args.microbatches * stages_per_rank * (3 if name == "zbv" else 2)
        excess_ms = (measured - formula) * step_s / actions * 1e3
        rows[name] = {
            "actions_per_rank": actions,
            "excess_idle_per_action_ms": excess_ms,
            "measured": measured,
            "measured_per_rank": per_rank,
            "formula": formula,
            "measured_over_formula": measured / formula,
            "simulated": simulated,
            "step_s": step_s,
            "cut_seconds": list(models[name].lamina_pp.cut.seconds),
        }
        ranks = " / ".join(f"{b:.3f}" for b in per_rank)
        print(f"{name:<16} {measured:>9.3f} {ranks:>15} {formula:>8.3f} "
              f"{measured / formula - 1:>+7.1%} {simulated:>9.3f} {step_s * 1e3:>8.0f} "
              f"{excess_ms:>+9.2f}")  # fmt: skip
    write_results(
        "pipeline_bubble",
        args.output,
        {
            "world_size": 2,
            "threads_per_rank": 1,
            "model": {"width": WIDTH, "layers": LAYERS, "vocab": VOCAB, "seq": SEQ},
            "global_batch": BATCH,
            "microbatches": args.microbatches,
            "activation_bytes": activation,
            "transfer_ms_one_way": transfer_ms,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "schedules": rows,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds after warm-up")
    parser.add_argument("--steps", type=int, default=3, help="steps per schedule per round")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    parser.add_argument("--output", default="pipeline_bubble.json")
    args = parser.parse_args()
    relaunch_under_torchrun(__file__, 2, env={"OMP_NUM_THREADS": "1"})
    run(args)


if __name__ == "__main__":
    main()
