"""Expert parallelism against ZeRO-3 alone on an MoE model: step time, measured and
predicted.

The model is transformers' Mixtral built from a config whose experts hold most of the
parameters (``--hidden`` 256, ``--intermediate`` 512, 8 experts, top-2, 2 layers, vocab
256: experts 94% of 6.7M parameters), one batch of ``--batch`` x ``--tokens`` (2 x 128)
per rank and step, the router's load-balancing loss in the loss, SGD. Two variants on
the same 4 ranks and mesh ``{"ep": 4}``: ``"ep"`` (each rank 2 of the 8 experts, tokens
moved to them, dense gradients averaged) and ``"zero3"`` (every parameter sharded over
the 4 ranks, gathered for forward and backward, gradients reduce-scattered). Steps run
in rounds with the order alternating (round 0 warms up); the step time is the slowest
rank's forward, backward and gradient sync, median.

Two parts, each its own job (the script launches it):

- ``loopback``: 4 gloo ranks on this machine (torchrun).
- ``emulated``: 2 emulated hosts x 2 ranks, each uplink shaped to ``--link`` (200
  Mbit/s), ranks in host order (needs root, ``lamina emulate``).

Each variant's step is also predicted by ``lamina.simulate.predict`` from its plan on the
cluster with links calibrated on the job by
:func:`lamina.comm.calibrate.calibrate` (gloo's own phases timed at two sizes, inside
a host and across hosts). ep's plan carries the
compute ep measured (a rank's forward and backward with its share of the experts and the
dispatch run in place, every rank at once) and token exchanges sized from the routing of
the example batches. ZeRO-3's plan has no compute in it: its prediction is its
collectives alone.

Writes ``results/expert_parallel.json`` (both parts' tables)::

    python benchmarks/expert_parallel.py [--part loopback emulated] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import lamina
from _interleaved import torchrun_command
from _links import calibrated_links
from _results import RESULTS, write_results
from emulated_training import INNER_ENV, run_emulated

VARIANTS = ("ep", "zero3")
VOCAB = 256


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=args.tokens,
        attn_implementation="sdpa",
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )
    return MixtralForCausalLM(config)


def _cluster(hosts: int, links: dict[str, dict[str, float]]) -> Any:
    from lamina.simulate import cluster_from_dict

    return cluster_from_dict(
        {"hosts": hosts, "devices_per_host": 4 // hosts, **links, "mesh": {"ep": 4}},
        "the benchmark's cluster, links calibrated on the job",
    )


def run(args: argparse.Namespace, part: str) -> None:
    torch.set_num_threads(1)
    runtime = lamina.init(mesh={"ep": 4})
    g = torch.Generator().manual_seed(1 + runtime.rank)
    x = torch.randint(0, VOCAB, (args.batch, args.tokens), generator=g)
    hosts = 2 if part == "emulated" else 1
    links = calibrated_links(runtime)
    models = {
        "ep": lamina.distribute(_model(args), "ep", example_inputs=(x,)),
        "zero3": lamina.distribute(_model(args), "zero3"),
    }
    optimizers = {v: torch.optim.SGD(models[v].parameters(), lr=0.01) for v in VARIANTS}
    from lamina.simulate import predict

    cluster = _cluster(hosts, links)
    predicted = {v: predict(models[v].execution_plan, cluster) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds + 1):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            model, opt = models[variant], optimizers[variant]
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                model(input_ids=x, labels=x).loss.backward()  # the gradient sync at its end
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                opt.step()
                opt.zero_grad(set_to_none=True)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if round_:
                    times[variant].append(float(took.item()))
        if runtime.rank == 0:
            print(f"round {round_} of {args.rounds} done", flush=True)
    if runtime.rank == 0:
        experts = sum(p.numel() for n, p in _model(args).named_parameters() if "experts" in n)
        whole = sum(p.numel() for p in _model(args).parameters())
        rows = {}
        for variant in VARIANTS:
            p = predicted[variant]
            measured = statistics.median(times[variant])
            rows[variant] = {
                "measured_step_s": measured,
                "predicted_step_s": p.step_s,
                "predicted_over_measured": p.step_s / measured,
                "predicted_collectives_s": p.total_s,
                "predicted_compute_s": p.expert.compute_s if p.expert else None,
                "steps_timed": len(times[variant]),
            }
        ratio = rows["ep"]["measured_step_s"] / rows["zero3"]["measured_step_s"]
        title = f"{part}: 4 ranks" + (f", 2 hosts x 2 at {args.link}" if hosts == 2 else "")
        print(f"\n{title}; experts {experts / whole:.1%} of {whole / 1e6:.1f}M parameters")
        print(f"{'variant':<8}{'measured s':>12}{'predicted s':>13}{'predicted/measured':>20}")
        for variant, row in rows.items():
            print(
                f"{variant:<8}{row['measured_step_s']:>12.3f}{row['predicted_step_s']:>13.3f}"
                f"{row['predicted_over_measured']:>20.3f}"
            )
        print(f"ep step / zero3 step: {ratio:.3f}")
        write_results(
            f"expert_parallel_{part}",
            f"expert_parallel_{part}.json",
            {
                "part": part,
                "link": args.link if hosts == 2 else "loopback",
                "model": (
                    f"Mixtral hidden {args.hidden}, intermediate {args.intermediate}, 8 experts "
                    f"top-2, 2 layers, vocab {VOCAB}; experts {experts / whole:.3f} of {whole} "
                    "parameters; SGD; load-balancing loss"
                ),
                "batch_per_rank": [args.batch, args.tokens],
                "links_calibrated": links,
                "rows": rows,
                "ep_over_zero3": ratio,
            },
        )
    lamina.shutdown()


def _combine(output: str) -> None:
    """Both parts' files as one results file."""
    combined = {}
    for part in ("loopback", "emulated"):
        path = RESULTS / f"expert_parallel_{part}.json"
        if path.exists():
            combined[part] = json.loads(path.read_text())
    write_results("expert_parallel", output, combined)
    for part in combined:
        (RESULTS / f"expert_parallel_{part}.json").unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["loopback", "emulated"])
    parser.add_argument("--link", default="200mbit", help="emulated link speed (200mbit)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", default="expert_parallel.json")
    parser.add_argument("--in-job", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.environ.get(INNER_ENV):
        run(args, "emulated")
        return
    if args.in_job:
        run(args, "loopback")
        return
    argv = list(sys.argv[1:])
    for part in args.part:
        if part == "loopback":
            cmd = torchrun_command(__file__, 4, [*argv, "--in-job", "loopback"])
            env = {**os.environ, "OMP_NUM_THREADS": "1", "LAMINA_BACKEND": "cpu"}
            if subprocess.call(cmd, env=env):
                sys.exit("the loopback job failed")
        elif part == "emulated":
            if run_emulated(args.link, __file__, argv, rank_order="ordered"):
                sys.exit("the emulated job failed")
        else:
            sys.exit(f"unknown part {part!r}; choose loopback or emulated")
    _combine(args.output)


if __name__ == "__main__":
    main()
