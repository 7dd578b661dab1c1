"""ZeRO-3 on an emulated 2-host cluster: hierarchical against flat gathers and
reduce-scatters, and against torch FSDP2.

Runs itself under ``lamina emulate`` like ``emulated_training.py`` (2 hosts x 2 gloo
ranks, interleaved, each uplink shaped to ``--link``, ``LAMINA_TOPOLOGY=probe``). The
examples' GPT under three variants, interleaved in one job (medians of the slowest
rank), every one sharded over all four ranks:

- ``zero3``: ``lamina.distribute(model, "zero3")``: the cost model picks each unit's
  algorithm (hierarchical across the slow link);
- ``zero3_flat``: the same with ``algorithm="flat"`` (what lamina did before);
- ``fsdp2``: torch ``fully_shard`` on every block and the root, on the 1-D world mesh.

Afterwards a fresh ``zero3`` model and torch DDP take 5 AdamW steps from one
initialization on the same batches and their parameters are compared (lossless).
Needs root::

    python benchmarks/emulated_zero3.py     # writes results/emulated_zero3.json
"""

from __future__ import annotations

from typing import Any

from torch import nn

import lamina
from _interleaved import add_ratios, base_parser, report, run_interleaved
from emulated_training import lossless_check, relaunch_emulated
from zero3_vs_fsdp2 import fsdp2

VARIANTS = ("zero3", "zero3_flat", "fsdp2")
PAIRS = (("zero3", "zero3_flat"), ("zero3", "fsdp2"))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "emulated_zero3.json", ("gpt",))
    parser.add_argument("--link", default="200mbit", help="emulated link speed (200mbit)")
    parser.set_defaults(rounds=4, steps=2)
    args = parser.parse_args()
    relaunch_emulated(args.link, __file__)

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        if variant == "zero3":
            return lamina.distribute(model, "zero3")
        if variant == "zero3_flat":
            return lamina.distribute(model, "zero3", algorithm="flat")
        return fsdp2(model)

    def describe(_name: str, models: dict[str, nn.Module]) -> dict[str, Any]:
        plan = models["zero3"].execution_plan  # type: ignore[union-attr]
        chosen = {
            n.unit: n.algorithm.name if n.algorithm else "flat"
            for n in plan.nodes
            if n.scatters_gradient
        }
        return {
            "zero3_vs_ddp_max_param_diff_after_5_steps": lossless_check(strategy="zero3"),
            "zero3_algorithms": chosen,
            "cost_model": dict(plan.meta).get("cost_model", ""),
        }

    results = run_interleaved(args, VARIANTS, wrap, describe)
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        add_ratios(results, PAIRS)
        report("emulated_zero3", results, VARIANTS, PAIRS, args, {"link": args.link})
    lamina.shutdown()


if __name__ == "__main__":
    main()
