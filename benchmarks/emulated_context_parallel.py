"""Context parallelism on an emulated 2-host cluster: the simulator's step against the
measured one, for each attention algorithm.

Runs itself under ``lamina emulate``: 2 hosts x 2 gloo ranks, interleaved, each uplink
shaped to ``--link`` (200 Mbit/s), links probed (``LAMINA_TOPOLOGY=probe``). The mesh is
the topology's ``inter`` x ``intra``. ``"cp"`` goes inside the hosts (``intra``) and
replicates over them (``inter``): the sequence is split between a host's two ranks, and
after backward the gradients are averaged over all four ranks with the cost model's
algorithm.

The model is the examples' GPT (d_model 128, 4 layers, 4 heads, vocab 64), one sequence
of ``--tokens`` (2048) tokens per replica and step, SGD. Each attention algorithm
(``pass_kv``, ``all_gather``, ``all_to_all``) is one variant. Steps run in rounds with
the order rotating (round 0 warms up); the step time is the slowest rank's forward,
backward and gradient sync (what the plan holds; SGD's update runs after the timing,
as the plan does not price the optimizer), median.

The prediction is ``lamina.simulate.predict`` on each model's plan. The cluster is
declared with the mesh ``{"inter": 2, "intra": 2}`` and the links calibrated on the job
(gloo's hierarchical phases inside and across the hosts timed at two sizes,
:func:`lamina.comm.calibrate.calibrate`), as a user describes a cluster from measured
links. The step is the
measured local compute plus the blocks cp adds, the ring's exposed transfers and the
collectives. The local compute is each rank's step on its own tokens with a one-element
all-reduce where the step exchanges (every rank timed at once, so each at its share of
the 2 cores the 4 ranks run on, and waiting for the last as in the step).

Each of ``--repeats`` (3) sittings distributes the models again (cp measures and plans
anew) and times them. The table and the JSON (``results/emulated_context_parallel.json``)
give both figures and their ratio per sitting, how many ratios are within 15%, and each
algorithm's median prediction over its median measured step.
Needs root::

    python benchmarks/emulated_context_parallel.py [--link 200mbit] [--rounds 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lamina
from _links import calibrated_links
from _results import write_results
from emulated_training import INNER_ENV, run_emulated
from lamina.strategies.contract import Placement

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig, lm_loss

ALGORITHMS = ("pass_kv", "all_gather", "all_to_all")
VOCAB = 64


def _cluster(links: dict[str, dict[str, float]]) -> Any:
    from lamina.simulate import cluster_from_dict

    return cluster_from_dict(
        {
            "hosts": 2,
            "devices_per_host": 2,
            **links,
            "mesh": {"inter": 2, "intra": 2},
        },
        "the emulated cluster, links calibrated on the job",
    )


def _sitting(
    args: argparse.Namespace,
    runtime: lamina.Runtime,
    x: torch.Tensor,
    y: torch.Tensor,
    links: dict[str, dict[str, float]],
) -> dict[str, dict[str, Any]]:
    """One repeat: every algorithm's model distributed (cp measures and plans again),
    predicted, then timed in rounds; rank 0's rows (empty elsewhere)."""
    placement = Placement(shard=("intra",), replicate=("inter",))
    models: dict[str, Any] = {}
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for algorithm in ALGORITHMS:
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=VOCAB, seq_len=args.tokens, d_model=128, n_layers=4, n_heads=4
        )
        model = lamina.distribute(
            GPT(config), "cp", placement=placement, example_inputs=(x,), attention=algorithm
        )
        models[algorithm] = model
        optimizers[algorithm] = torch.optim.SGD(model.parameters(), lr=0.01)
    cluster = _cluster(links)
    from lamina.simulate import predict

    predicted = {a: predict(models[a].execution_plan, cluster) for a in ALGORITHMS}
    times: dict[str, list[float]] = {a: [] for a in ALGORITHMS}
    for round_ in range(args.rounds + 1):
        order = ALGORITHMS[round_ % 3 :] + ALGORITHMS[: round_ % 3]
        for algorithm in order:
            model, opt = models[algorithm], optimizers[algorithm]
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                lm_loss(model(x), y).backward()  # the gradient sync runs at its end
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                opt.step()
                opt.zero_grad(set_to_none=True)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if round_:
                    times[algorithm].append(float(took.item()))
    rows: dict[str, dict[str, Any]] = {}
    if runtime.rank == 0:
        for algorithm in ALGORITHMS:
            p = predicted[algorithm]
            measured = statistics.median(times[algorithm])
            context = p.context
            rows[algorithm] = {
                "measured_step_s": measured,
                "predicted_step_s": p.step_s,
                "predicted_over_measured": p.step_s / measured,
                "predicted_compute_s": context.compute_s if context else None,
                "predicted_ring_exposed_s": context.ring_exposed_s if context else None,
                "predicted_collectives_s": p.total_s,
                "steps_timed": len(times[algorithm]),
            }
    return rows


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    runtime = lamina.init(mesh="topology")
    assert runtime.mesh.size("inter") == 2, "the benchmark runs on 2 emulated hosts"
    replica = runtime.mesh.coordinates()["inter"]
    g = torch.Generator().manual_seed(1 + replica)
    x = torch.randint(0, VOCAB, (1, args.tokens), generator=g)
    y = torch.randint(0, VOCAB, (1, args.tokens), generator=g)
    repeats = []
    links = calibrated_links(runtime)
    for repeat in range(args.repeats):
        repeats.append(_sitting(args, runtime, x, y, links))
        if runtime.rank == 0:
            print(f"repeat {repeat + 1} of {args.repeats} done", flush=True)
    if runtime.rank == 0:
        print(f"\ncp=2 inside each host, 2 hosts at {args.link}, {args.tokens} tokens per replica")
        print(
            f"{'repeat':<8}{'algorithm':<12}{'measured s':>12}{'predicted s':>13}{'ratio':>8}"
            f"{'compute s':>11}{'collectives s':>15}"
        )
        for i, rows in enumerate(repeats, 1):
            for algorithm, row in rows.items():
                print(
                    f"{i:<8}{algorithm:<12}{row['measured_step_s']:>12.3f}"
                    f"{row['predicted_step_s']:>13.3f}{row['predicted_over_measured']:>8.3f}"
                    f"{row['predicted_compute_s']:>11.3f}{row['predicted_collectives_s']:>15.3f}"
                )
        ratios = [r["predicted_over_measured"] for rows in repeats for r in rows.values()]
        within = sum(abs(r - 1) <= 0.15 for r in ratios)
        print(f"{within} of {len(ratios)} predictions within 15% of the measured step")
        # each algorithm's prediction against its median measured step over the sittings
        medians = {}
        for algorithm in ALGORITHMS:
            measured = statistics.median(r[algorithm]["measured_step_s"] for r in repeats)
            predicted = statistics.median(r[algorithm]["predicted_step_s"] for r in repeats)
            medians[algorithm] = {
                "measured_step_s": measured,
                "predicted_step_s": predicted,
                "predicted_over_measured": predicted / measured,
            }
            print(
                f"{algorithm}: median predicted {predicted:.3f} s over median measured "
                f"{measured:.3f} s = {predicted / measured:.3f}"
            )
        write_results(
            "emulated_context_parallel",
            args.output,
            {
                "link": args.link,
                "tokens": args.tokens,
                "model": "GPT d_model 128, 4 layers, 4 heads, vocab 64; SGD",
                "mesh": "inter 2 x intra 2 (cp on intra, replicated over inter), ranks interleaved",
                "links_calibrated": links,
                "repeats": repeats,
                "within_15_percent": f"{within} of {len(ratios)}",
                "medians": medians,
            },
        )
    lamina.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="200mbit", help="emulated link speed (200mbit)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="sittings, each measured anew")
    parser.add_argument("--output", default="emulated_context_parallel.json")
    args = parser.parse_args()
    if not os.environ.get(INNER_ENV):
        argv = list(sys.argv[1:])
        if "--link" not in argv:
            argv += ["--link", args.link]
        sys.exit(run_emulated(args.link, __file__, argv))
    run(args)


if __name__ == "__main__":
    main()
