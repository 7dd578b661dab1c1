"""lamina DP vs torch DDP vs the compute-only limit, interleaved in one run.

Two gloo ranks (``--nproc N`` for N), one thread each, the workloads of
``_interleaved.py``: the 4 x 1024 MLP, the 4 x 512 MLP (``mlp512``: a small model, where
latency-bound buckets show) and the GPT, AdamW. The table reports median step times,
the ratios lamina/DDP and lamina/limit, and the peak RSS each variant reached. Results
go to ``results/dp_vs_ddp.json`` (2 ranks) or ``results/dp_vs_ddp_<N>ranks.json``.
Run it as::

    python benchmarks/dp_vs_ddp.py            # re-launches itself under torchrun, 2 ranks
    python benchmarks/dp_vs_ddp.py --nproc 4 --only mlp512
    lamina run --nproc-per-node 2 benchmarks/dp_vs_ddp.py
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from _interleaved import (
    WORKLOADS,
    add_ratios,
    base_parser,
    relaunch_under_torchrun,
    report,
    run_interleaved,
    without_nproc,
)

VARIANTS = ("lamina", "ddp", "limit")
PAIRS = (("lamina", "ddp"), ("lamina", "limit"), ("ddp", "limit"))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "", WORKLOADS)
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="lamina's bucket cap (default: auto)"
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="ranks to launch without torchrun (default 2)"
    )
    args = parser.parse_args()
    relaunch_under_torchrun(__file__, nproc=args.nproc, argv=without_nproc(sys.argv[1:]))

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        if variant == "lamina":
            return lamina.distribute(model, "dp", bucket_cap_mb=args.bucket_cap_mb)
        if variant == "ddp":
            return DDP(model)
        return model  # the limit: the same compute, no gradient synchronization

    def describe(_name: str, models: dict[str, nn.Module]) -> dict[str, Any]:
        plan = models["lamina"].plan  # type: ignore[union-attr]
        return {
            "lamina_buckets": len(plan.buckets),
            "lamina_bucket_bytes": [b.nbytes for b in plan.buckets],
        }

    results = run_interleaved(args, VARIANTS, wrap, describe)
    if lamina.current() is not None and lamina.current().is_main:  # type: ignore[union-attr]
        add_ratios(results, PAIRS)
        if not args.output:
            world = lamina.current().world_size  # type: ignore[union-attr]
            args.output = "dp_vs_ddp.json" if world == 2 else f"dp_vs_ddp_{world}ranks.json"
        report(
            "dp_vs_ddp",
            results,
            VARIANTS,
            PAIRS,
            args,
            {"lamina_bucket_cap_mb": args.bucket_cap_mb},
        )
    lamina.shutdown()


if __name__ == "__main__":
    main()
