"""lamina ZeRO-3 vs torch FSDP2 (``fully_shard``) vs the compute-only limit, interleaved.

Two gloo ranks, one thread each, the MLP and GPT workloads of ``_interleaved.py``,
AdamW. FSDP2 shards each layer / transformer block, then the root. Run it as::

    python benchmarks/zero3_vs_fsdp2.py       # re-launches itself under torchrun, 2 ranks
"""

from __future__ import annotations

from typing import Any

from torch import nn

import lamina
from _interleaved import add_ratios, base_parser, relaunch_under_torchrun, report, run_interleaved

VARIANTS = ("lamina", "fsdp2", "limit")
PAIRS = (("lamina", "fsdp2"), ("lamina", "limit"), ("fsdp2", "limit"))


def fsdp2(model: nn.Module) -> nn.Module:
    """``fully_shard`` on every block (GPT) or Linear (MLP), then on the root."""
    from torch.distributed.fsdp import fully_shard

    runtime = lamina.current()
    assert runtime is not None
    mesh = runtime.mesh.torch_mesh
    blocks = getattr(model, "blocks", None)
    children = (
        list(blocks)
        if blocks is not None
        else [m for m in model.children() if isinstance(m, nn.Linear)]
    )
    for child in children:
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "zero3_vs_fsdp2.json")
    parser.add_argument(
        "--min-unit-numel",
        type=int,
        default=0,
        help="lamina: merge blocks smaller than this (default 0: unit per block)",
    )
    args = parser.parse_args()
    relaunch_under_torchrun(__file__)

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        if variant == "lamina":
            return lamina.distribute(model, "zero3", min_unit_numel=args.min_unit_numel)
        if variant == "fsdp2":
            return fsdp2(model)
        return model  # the limit: the same compute, no communication, no sharding

    def describe(_name: str, models: dict[str, nn.Module]) -> dict[str, Any]:
        layout = models["lamina"].layout  # type: ignore[union-attr]
        return {"lamina_units": len(layout.units), "lamina_bytes_per_rank": layout.bytes_per_rank()}

    results = run_interleaved(args, VARIANTS, wrap, describe)
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        add_ratios(results, PAIRS)
        report(
            "zero3_vs_fsdp2",
            results,
            VARIANTS,
            PAIRS,
            args,
            {"lamina_min_unit_numel": args.min_unit_numel},
        )
    lamina.shutdown()


if __name__ == "__main__":
    main()
