"""lamina HSDP vs torch FSDP2's HSDP vs lamina ZeRO-3 vs the compute-only limit, interleaved.

Four gloo ranks, one thread each, on a declared topology of 2 hosts x 2 ranks (written to
a temporary file and passed to the ranks as ``$LAMINA_TOPOLOGY``); ``lamina.init(mesh=
"topology")`` builds the ``inter`` x ``intra`` mesh from its fast domains. The MLP and GPT
workloads of ``_interleaved.py``, AdamW. Variants, on that one mesh:

- ``hsdp``: ``lamina.distribute(model, "hsdp")``: shards over ``intra`` (inside a host),
  replicas over ``inter``; the shard gradient is all-reduced across hosts;
- ``fsdp2``: torch's ``fully_shard`` on each Linear / transformer block, then the root,
  with the 2-D mesh: FSDP2's HSDP (replicate over dim 0 ``inter``, shard over dim 1
  ``intra``, placements ``(Replicate(), Shard(0))``);
- ``zero3``: ``lamina.distribute(model, "zero3")`` sharded over both axes (the whole job);
- ``limit``: the same compute, no communication, no sharding.

Run it as::

    python benchmarks/hsdp_vs_fsdp2.py     # writes the topology, re-launches on 4 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from torch import nn

import lamina
from _interleaved import add_ratios, base_parser, relaunch_under_torchrun, report, run_interleaved
from lamina.session import TOPOLOGY_ENV
from lamina.strategies.zero3 import ShardedModule
from zero3_vs_fsdp2 import fsdp2

VARIANTS = ("hsdp", "fsdp2", "zero3", "limit")
PAIRS = (("hsdp", "fsdp2"), ("hsdp", "zero3"), ("hsdp", "limit"), ("fsdp2", "limit"))
#: Lamina's variants: strategy name and placement (None: the strategy's default).
LAMINA_VARIANTS = {
    "hsdp": ("hsdp", None),
    "zero3": ("zero3", lamina.Placement(shard=("inter", "intra"))),
}


def declared_topology(hosts: int, ranks_per_host: int) -> dict[str, Any]:
    """A topology file's content: ``hosts`` hosts of ``ranks_per_host`` CPU ranks each,
    shared-memory links inside a host (one fast domain per host), network between."""
    world = hosts * ranks_per_host
    host_of = [f"node-{r // ranks_per_host}" for r in range(world)]
    return {
        "version": 1,
        "devices": [
            {
                "rank": r,
                "local_rank": r % ranks_per_host,
                "host": host_of[r],
                "device_type": "cpu",
                "device_index": r % ranks_per_host,
            }
            for r in range(world)
        ],
        "links": [
            {"a": a, "b": b, "bandwidth_gbps": 40.0, "latency_us": 1.0, "kind": "shm"}
            for a in range(world)
            for b in range(a + 1, world)
            if host_of[a] == host_of[b]
        ],
        "fast_domains": [
            {
                "name": f"node-{h}",
                "ranks": list(range(h * ranks_per_host, (h + 1) * ranks_per_host)),
            }
            for h in range(hosts)
        ],
        "default_link": {"bandwidth_gbps": 12.5, "latency_us": 10.0, "kind": "network"},
    }


def plan_bytes(model: ShardedModule) -> dict[str, int]:
    """Bytes of the buffers one step's planned collectives take, by ``op@axis`` (the
    wrap-time broadcast excluded): what this rank sends over each mesh axis, up to the
    algorithm's factor (a ring all-reduce sends 2(n-1)/n of its buffer)."""
    totals: dict[str, int] = defaultdict(int)
    for node in model.execution_plan.collectives():
        spec = node.collective
        if spec is not None and not node.id.startswith("setup."):
            totals[f"{spec.op}@{spec.axis}"] += spec.nbytes
    return dict(sorted(totals.items()))


def fsdp2_placements(model: nn.Module) -> list[str]:
    """The distinct DTensor placements of FSDP2's sharded parameters."""
    return sorted({str(tuple(getattr(p, "placements", ()))) for p in model.parameters()})


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "hsdp_vs_fsdp2.json")
    parser.set_defaults(rounds=6, steps=5)
    parser.add_argument(
        "--min-unit-numel",
        type=int,
        default=0,
        help="lamina: merge blocks smaller than this (default 0: unit per block)",
    )
    parser.add_argument("--hosts", type=int, default=2, help="declared hosts (inter)")
    parser.add_argument("--ranks-per-host", type=int, default=2, help="ranks per host (intra)")
    args = parser.parse_args()
    # the file lives as long as this process: the launcher's (for its ranks) or a rank's
    # own when started under torchrun without $LAMINA_TOPOLOGY
    with tempfile.TemporaryDirectory(prefix="lamina-hsdp-bench-") as tmp:
        declared = os.environ.get(TOPOLOGY_ENV)
        path = declared or str(Path(tmp) / "topology.json")
        if not declared:
            topology = declared_topology(args.hosts, args.ranks_per_host)
            Path(path).write_text(json.dumps(topology, indent=2))
            os.environ[TOPOLOGY_ENV] = path
        relaunch_under_torchrun(
            __file__, nproc=args.hosts * args.ranks_per_host, env={TOPOLOGY_ENV: path}
        )
        run(args, json.loads(Path(path).read_text()))


def run(args: argparse.Namespace, topology: dict[str, Any]) -> None:
    """One rank's part: time the variants; rank 0 prints and writes the results, with the
    declared ``topology``."""

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        if variant in LAMINA_VARIANTS:
            strategy, placement = LAMINA_VARIANTS[variant]
            return lamina.distribute(
                model, strategy, placement=placement, min_unit_numel=args.min_unit_numel
            )
        if variant == "fsdp2":
            return fsdp2(model)  # on the 2-D mesh: FSDP2's HSDP
        return model  # the limit: the same compute, no communication, no sharding

    def describe(_name: str, models: dict[str, nn.Module]) -> dict[str, Any]:
        out: dict[str, Any] = {"fsdp2_placements": fsdp2_placements(models["fsdp2"])}
        for variant in LAMINA_VARIANTS:
            model = models[variant]
            assert isinstance(model, ShardedModule)
            layout = model.lamina_layout
            out[f"{variant}_units"] = len(layout.units)
            out[f"{variant}_bytes_per_rank"] = layout.bytes_per_rank()
            out[f"{variant}_shard_world"] = layout.world_size
            out[f"{variant}_plan_bytes_per_step"] = plan_bytes(model)
        return out

    results = run_interleaved(args, VARIANTS, wrap, describe, mesh="topology")
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        add_ratios(results, PAIRS)
        report(
            "hsdp_vs_fsdp2",
            results,
            VARIANTS,
            PAIRS,
            args,
            {
                "lamina_min_unit_numel": args.min_unit_numel,
                "mesh": {
                    "axes": list(runtime.mesh.axis_names),
                    "ranks": runtime.mesh.ranks(),
                },
                "topology": topology,
            },
        )
    lamina.shutdown()


if __name__ == "__main__":
    main()
