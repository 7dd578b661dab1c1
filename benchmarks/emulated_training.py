"""Training on an emulated 2-host cluster: lamina DP and HSDP against torch DDP and FSDP2.

Runs itself under ``lamina emulate`` (2 hosts x 2 gloo ranks, ranks interleaved across
the hosts as ``srun --distribution=cyclic`` numbers them, each host's uplink shaped to
``--link``), with ``LAMINA_TOPOLOGY=probe``: ``lamina.init`` measures the links, and
the DP plan picks each bucket's all-reduce algorithm from the cost model. The examples'
GPT (``_interleaved.py``'s benchmark size) under four variants, interleaved in one job
(medians of the slowest rank):

- ``dp``: ``lamina.distribute(model, "dp")``, the algorithms chosen by the cost model;
- ``ddp``: torch ``DistributedDataParallel`` on the job's group;
- ``hsdp``: ``lamina.distribute(model, "hsdp")`` on the topology's ``inter`` x ``intra``
  mesh (shards inside a host, replicas across);
- ``fsdp2``: torch ``fully_shard`` with the same 2-D mesh (FSDP2's HSDP).

After timing, fresh ``dp`` and ``ddp`` models from one initialization take 5 AdamW
steps (lr 1e-3) on the same batches and their parameters are compared: the algorithms
the plan chose must be lossless. Needs root::

    python benchmarks/emulated_training.py     # writes results/emulated_training.json
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from _interleaved import add_ratios, base_parser, report, run_interleaved, workloads
from zero3_vs_fsdp2 import fsdp2

VARIANTS = ("dp", "ddp", "hsdp", "fsdp2")
PAIRS = (("dp", "ddp"), ("hsdp", "fsdp2"), ("hsdp", "ddp"))
INNER_ENV = "LAMINA_EMULATED_TRAINING_INNER"


def relaunch_emulated(link: str, script: str = __file__) -> None:
    """Outside the emulated job: start ``script`` in it (4 ranks on 2 emulated hosts)
    and exit."""
    if os.environ.get(INNER_ENV):
        return
    sys.exit(run_emulated(link, script, sys.argv[1:]))


def run_emulated(link: str, script: str, argv: list[str], rank_order: str = "interleaved") -> int:
    """Run ``script argv`` as the job of 2 emulated hosts x 2 ranks joined by ``link``
    (ranks ``interleaved`` across the hosts, or ``ordered`` host by host); its exit
    status."""
    if os.geteuid() != 0:
        sys.exit(f"{os.path.basename(script)}: lamina emulate needs root (network namespaces)")
    cmd = [
        sys.executable, "-m", "lamina.cli.main", "emulate", "--hosts", "2",
        "--nproc-per-host", "2", "--link", link, "--rank-order", rank_order,
        "--timeout", "1500", "--",
    ]  # fmt: skip
    # one task per host (ordered) runs the script through `lamina run` with the host's
    # ranks; one task per rank (interleaved) runs `lamina run` as given
    launch = [] if rank_order == "ordered" else ["lamina", "run"]
    cmd += [*launch, os.path.abspath(script), *argv]
    env = {**os.environ, INNER_ENV: "1", "LAMINA_TOPOLOGY": "probe"}
    return subprocess.call(cmd, env=env)


def lossless_check(steps: int = 5, strategy: str = "dp", **options: Any) -> float:
    """Max parameter difference between lamina's ``strategy`` and DDP after ``steps``
    AdamW steps from one initialization on the same batches."""
    runtime = lamina.current()
    assert runtime is not None
    build, make_batch, loss_fn = workloads(runtime.rank)["gpt"]
    torch.manual_seed(0)
    initial = build()
    ours = lamina.distribute(copy.deepcopy(initial), strategy, **options)
    ddp = DDP(copy.deepcopy(initial))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, ddp)]
    for step in range(steps):
        x, y = make_batch(step)
        for model, opt in zip((ours, ddp), opts, strict=True):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return max(
        (_whole(a) - b).abs().max().item()
        for a, b in zip(ours.parameters(), ddp.module.parameters(), strict=True)
    )


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A sharded parameter gathered whole (a plain one as it is)."""
    return param.full_tensor() if isinstance(param, DTensor) else param


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "emulated_training.json", ("gpt",))
    parser.add_argument("--link", default="200mbit", help="emulated link speed (200mbit)")
    parser.set_defaults(rounds=4, steps=2)
    args = parser.parse_args()
    relaunch_emulated(args.link)

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        if variant == "dp":
            return lamina.distribute(model, "dp")
        if variant == "ddp":
            return DDP(model)
        if variant == "hsdp":
            return lamina.distribute(model, "hsdp")
        return fsdp2(model)

    def describe(_name: str, models: dict[str, nn.Module]) -> dict[str, Any]:
        plan = models["dp"].execution_plan  # type: ignore[union-attr]
        chosen = [
            n.algorithm.name if n.algorithm else "flat"
            for n in plan.collectives()
            if n.id.startswith("bucket")
        ]
        return {
            "dp_vs_ddp_max_param_diff_after_5_steps": lossless_check(),
            "dp_algorithms": chosen,
            "cost_model": dict(plan.meta).get("cost_model", ""),
        }

    results = run_interleaved(args, VARIANTS, wrap, describe, mesh="topology")
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        add_ratios(results, PAIRS)
        report("emulated_training", results, VARIANTS, PAIRS, args, {"link": args.link})
    lamina.shutdown()


if __name__ == "__main__":
    main()
