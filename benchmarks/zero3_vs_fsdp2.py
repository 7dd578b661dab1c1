"""lamina ZeRO-3 vs torch FSDP2 (``fully_shard``) vs the compute-only limit, interleaved.

The MLP and GPT workloads of ``_interleaved.py``, AdamW, one thread per rank. FSDP2
shards each layer / transformer block, then the root. ``--nproc 2`` (the default): two
ranks, variants lamina, fsdp2 and the compute-only limit (the same ranks, no
communication, no sharding). ``--nproc 1``: one rank, variants lamina, fsdp2 and the
plain, unwrapped model (what ZeRO-3's machinery costs when there is nothing to shard
over). ``--device cpu`` (the default) runs gloo ranks on the CPU; ``--device cuda`` runs
NCCL ranks, one per GPU (the device comes from the runtime; steps are timed between
device synchronizations, and the memory column is the device's peak allocation). Run it
as::

    python benchmarks/zero3_vs_fsdp2.py               # re-launches itself under torchrun
    python benchmarks/zero3_vs_fsdp2.py --nproc 1     # results/zero3_vs_fsdp2_ws1.json
    python benchmarks/zero3_vs_fsdp2.py --device cuda # on a GPU machine
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist
from torch import nn

import lamina
from _interleaved import (
    add_ratios,
    base_parser,
    relaunch_under_torchrun,
    report,
    run_interleaved,
    without_nproc,
)
from lamina.strategies.zero3 import ShardedModule

#: (variants, ratio pairs) by world size: with one rank the baseline is the plain model.
VARIANTS = {1: ("lamina", "fsdp2", "plain"), 2: ("lamina", "fsdp2", "limit")}
PAIRS = {
    1: (("lamina", "plain"), ("fsdp2", "plain"), ("lamina", "fsdp2")),
    2: (("lamina", "fsdp2"), ("lamina", "limit"), ("fsdp2", "limit")),
}
#: lamina backend (and collective backend) per ``--device``
BACKENDS = {"cpu": "cpu", "cuda": "cuda"}


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


def output_name(nproc: int, device: str) -> str:
    """Default result file: ``zero3_vs_fsdp2[_ws1][_cuda].json``."""
    return (
        "zero3_vs_fsdp2"
        + ("" if nproc == 2 else f"_ws{nproc}")
        + ("" if device == "cpu" else f"_{device}")
        + ".json"
    )


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "")
    parser.add_argument(
        "--min-unit-numel",
        type=int,
        default=0,
        help="lamina: merge blocks smaller than this (default 0: unit per block)",
    )
    parser.add_argument(
        "--nproc", type=int, choices=(1, 2), default=2, help="ranks (default 2; 1: vs plain)"
    )
    parser.add_argument(
        "--device",
        choices=sorted(BACKENDS),
        default="cpu",
        help="cpu: gloo ranks; cuda: NCCL ranks, one per GPU (default cpu)",
    )
    args = parser.parse_args()
    args.output = args.output or output_name(args.nproc, args.device)
    # torchrun's own parser would take "--nproc" for an ambiguous "--nproc-per-node":
    # the ranks get the rank count from the environment instead
    relaunch_under_torchrun(
        __file__, nproc=args.nproc, argv=[*without_nproc(sys.argv[1:]), "--output", args.output]
    )
    nproc = int(os.environ.get("WORLD_SIZE", args.nproc))
    variants, pairs = VARIANTS[nproc], PAIRS[nproc]

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        if variant == "lamina":
            return lamina.distribute(model, "zero3", min_unit_numel=args.min_unit_numel)
        if variant == "fsdp2":
            return fsdp2(model)
        return model  # limit / plain: the same compute, no communication, no sharding

    def describe(_name: str, models: dict[str, nn.Module]) -> dict[str, Any]:
        model = models["lamina"]
        assert isinstance(model, ShardedModule)
        layout = model.lamina_layout
        return {"lamina_units": len(layout.units), "lamina_bytes_per_rank": layout.bytes_per_rank()}

    results = run_interleaved(args, variants, wrap, describe, backend=BACKENDS[args.device])
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        add_ratios(results, pairs)
        report(
            "zero3_vs_fsdp2",
            results,
            variants,
            pairs,
            args,
            {
                "lamina_min_unit_numel": args.min_unit_numel,
                "device": str(runtime.device.type),
                "collective_backend": str(dist.get_backend()),
                "memory": "peak RSS" if runtime.device.type == "cpu" else "device peak",
            },
        )
    lamina.shutdown()


if __name__ == "__main__":
    main()
