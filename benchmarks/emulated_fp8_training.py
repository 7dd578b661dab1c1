"""The GPT DP step with fp8 gradients on an emulated 2-host cluster, against fp32.

Runs itself under ``lamina emulate`` like ``emulated_training.py`` (2 hosts x 2 gloo
ranks, interleaved, each uplink shaped to ``--link``, links probed). The examples' GPT
(``_interleaved.py``'s benchmark size) under four variants, interleaved in one job
(medians of the slowest rank):

- ``fp32``: ``lamina.distribute(model, "dp")``, the cost model's algorithm per bucket;
- ``fp8``: ``codec="fp8"``: every bucket summed in two fp8 phases over the whole group;
- ``fp8-inter``: ``codec="fp8", codec_scope="inter"``: the hierarchical algorithm, exact
  inside each host, fp8 between the hosts;
- ``ddp``: torch ``DistributedDataParallel`` for reference.

Also reports the bytes the run log counted for one step of each variant (what the trace
records) and their ratio to fp32. The same job runs a second time with a link of
``--floor-link`` (10 Gbit/s: communication nearly free), which gives each variant's
compute floor; a step's time above its floor is what the link costs it, and the fp32
step over its floor bounds what any codec can gain. Needs root::

    python benchmarks/emulated_fp8_training.py     # writes results/emulated_fp8_training.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from _interleaved import add_ratios, base_parser, report, run_interleaved
from _results import RESULTS
from emulated_training import INNER_ENV, run_emulated

VARIANTS = ("fp32", "fp8", "fp8-inter", "ddp")
PAIRS = (("fp8", "fp32"), ("fp8-inter", "fp32"), ("fp8-inter", "fp8"), ("fp8", "ddp"))
OPTIONS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp8": {"codec": "fp8"},
    "fp8-inter": {"codec": "fp8", "codec_scope": "inter"},
}


def both_links(link: str, floor_link: str, output: str, argv: list[str]) -> None:
    """Outside the emulated jobs: run the benchmark at ``link`` and at ``floor_link``,
    then merge both into ``results/<output>`` with each variant's link cost."""
    with tempfile.TemporaryDirectory() as tmp:
        parts = {}
        for name, speed in (("link", link), ("floor", floor_link)):
            path = Path(tmp) / f"{name}.json"
            status = run_emulated(speed, __file__, [*argv, "--link", speed, "--output", str(path)])
            if status:
                sys.exit(status)
            parts[name] = json.loads(path.read_text())
    merged = parts["link"]
    floor = parts["floor"]["results"]
    for workload, result in merged["results"].items():
        at_link, at_floor = result["median_step_s"], floor[workload]["median_step_s"]
        result["floor_link"] = floor_link
        result["floor_step_s"] = at_floor
        result["link_cost_s"] = {v: at_link[v] - at_floor[v] for v in at_link}
        cost = result["link_cost_s"]
        result["link_cost_over_fp32"] = {v: cost[v] / cost["fp32"] for v in cost}
        result["fp32_over_its_floor"] = at_link["fp32"] / at_floor["fp32"]
        print(
            f"{workload}: step at {floor_link} (compute floor) "
            + ", ".join(f"{v} {at_floor[v] * 1e3:.1f} ms" for v in at_floor)
        )
        print(
            f"{workload}: what the {link} link costs a step "
            + ", ".join(
                f"{v} {cost[v] * 1e3:.1f} ms ({cost[v] / cost['fp32']:.2f}x fp32)" for v in cost
            )
        )
        print(f"{workload}: fp32 step / its compute floor {result['fp32_over_its_floor']:.2f} "
              "(the most any codec can gain here)")  # fmt: skip
    out = RESULTS / output
    out.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "emulated_fp8_training.json", ("gpt",))
    parser.add_argument("--link", default="200mbit", help="emulated link speed (200mbit)")
    parser.add_argument(
        "--floor-link", default="10gbit", help="the link of the compute-floor run (10gbit)"
    )
    parser.set_defaults(rounds=4, steps=2)
    args = parser.parse_args()
    if not os.environ.get(INNER_ENV):
        both_links(args.link, args.floor_link, args.output, _without_links(sys.argv[1:]))
        return

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        if variant == "ddp":
            return DDP(model)
        return lamina.distribute(model, "dp", **OPTIONS[variant])

    def describe(_name: str, models: dict[str, nn.Module]) -> dict[str, Any]:
        step_bytes = {v: models[v].run_log.last.nbytes for v in OPTIONS}  # type: ignore[union-attr]
        plans = {v: models[v].execution_plan for v in OPTIONS}
        return {
            "step_bytes": step_bytes,
            "step_bytes_over_fp32": {v: step_bytes[v] / step_bytes["fp32"] for v in OPTIONS},
            "algorithms": {
                v: sorted(
                    {
                        n.algorithm.name if n.algorithm else "flat"
                        for n in p.collectives()
                        if "bucket" in n.id
                    }
                )  # type: ignore[union-attr]
                for v, p in plans.items()
            },
            "error_feedback_bytes": {
                v: sum(n.codec.residual_bytes for n in p.collectives() if n.codec)  # type: ignore[union-attr]
                for v, p in plans.items()
            },
            "fallbacks": {v: len(models[v].run_log.events) for v in OPTIONS},  # type: ignore[union-attr]
        }

    results = run_interleaved(args, VARIANTS, wrap, describe, mesh="topology")
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        add_ratios(results, PAIRS)
        for name, r in results.items():
            print(f"{name}: bytes per step over fp32 {r['step_bytes_over_fp32']}")
        report("emulated_fp8_training", results, VARIANTS, PAIRS, args, {"link": args.link})
    lamina.shutdown()


def _without_links(argv: list[str]) -> list[str]:
    """``argv`` without --link / --output / --floor-link (each run gets its own)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--link", "--output", "--floor-link"):
            skip = True
            continue
        if not arg.startswith(("--link=", "--output=", "--floor-link=")):
            out.append(arg)
    return out


if __name__ == "__main__":
    main()
