"""lamina DP vs torch DDP vs the compute-only limit, interleaved in one run.

Two gloo ranks, one thread each, the MLP and GPT workloads of ``_interleaved.py``,
AdamW. The table reports median step times, the ratios lamina/DDP and lamina/limit, and
the peak RSS each variant reached. Run it as::

    python benchmarks/dp_vs_ddp.py            # re-launches itself under torchrun, 2 ranks
    lamina run --nproc-per-node 2 benchmarks/dp_vs_ddp.py
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from _interleaved import add_ratios, base_parser, relaunch_under_torchrun, report, run_interleaved

VARIANTS = ("lamina", "ddp", "limit")
PAIRS = (("lamina", "ddp"), ("lamina", "limit"), ("ddp", "limit"))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "dp_vs_ddp.json")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="lamina's bucket cap (default: auto)"
    )
    args = parser.parse_args()
    relaunch_under_torchrun(__file__)

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        if variant == "lamina":
            return lamina.distribute(model, "dp", bucket_cap_mb=args.bucket_cap_mb)
        if variant == "ddp":
            return DDP(model)
        return model  # the limit: the same compute, no gradient synchronization

    def describe(_name: str, models: dict[str, nn.Module]) -> dict[str, Any]:
        return {"lamina_buckets": len(models["lamina"].plan.buckets)}  # type: ignore[union-attr]

    results = run_interleaved(args, VARIANTS, wrap, describe)
    if lamina.current() is not None and lamina.current().is_main:  # type: ignore[union-attr]
        add_ratios(results, PAIRS)
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
