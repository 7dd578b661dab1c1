"""Pipeline parallelism across an emulated slow link, against DP, HSDP, DDP and torch's own
pipelining.

Runs itself under ``lamina emulate`` (2 hosts x 2 gloo ranks, interleaved, each uplink
shaped to ``--link``, links probed), on the topology's ``inter`` x ``intra`` mesh. The
examples' GPT at width 512 with 8 blocks (29.6M parameters: 118 MB of fp32 gradients per
step against 0.5 MB of activations crossing the cut per microbatch), one global batch of
16 sequences per step under every variant, interleaved in rotating order (medians of the
slowest rank):

- ``pp-1f1b``, ``pp-zbv``: ``lamina.distribute(model, "pp", schedule=...)``: two stages
  across the hosts (``inter``), replicated inside each host (``intra``); 8 sequences per
  pipeline in 4 microbatches;
- ``dp``: ``lamina.distribute(model, "dp")`` (the cost model's algorithm per bucket:
  hierarchical here), 4 sequences per rank;
- ``hsdp``: shards inside a host, replicas across;
- ``ddp``: torch ``DistributedDataParallel``;
- ``torch-pp-1f1b``: torch.distributed.pipelining by hand: the blocks split 4 + 4 (the
  head its own copy of the embedding, as a hand split gives it), ``Schedule1F1B``, each
  stage in ``DistributedDataParallel`` over its host's ranks;
- ``pp-1f1b-untied``: lamina's 1F1B on the model the hand split trains (the head its own
  copy of the embedding, so no tied gradient crosses the link): the like-for-like
  comparison with ``torch-pp-1f1b``. The tied model's ``pp-1f1b`` also sums the tied
  weight's gradient across the stages (1/R of it per pipeline, R = 2 pipelines).

Also predicts each lamina pipeline's step with ``lamina plan --simulate``'s model
(``lamina.simulate.predict`` on the plan, the cluster declared from the probed links)
and reports it against the measurement. Reports step time, the bytes each host sent over
its link per step (its interface's counter), and for lamina's pipelines the bubble
against the schedule's formula: measured as each rank's fraction of the schedule's part
of the step (before the gradient sync) spent outside its stages' forward and backward
chunks (``model.lamina_pp.engine.last_phases``), the mean over the ranks; and estimated
as ``1 - m * t_stage / t_schedule`` from the cut's stage times (``t_stage``: the slowest
stage's forward + backward of one microbatch, timed alone at ``distribute``). Needs
root::

    python benchmarks/emulated_pipeline.py     # writes results/emulated_pipeline.json
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from _interleaved import base_parser
from _results import write_results
from emulated_training import INNER_ENV, run_emulated

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _gpt_model import GPT, GPTConfig, lm_loss

VARIANTS = ("pp-1f1b", "pp-zbv", "dp", "hsdp", "ddp", "torch-pp-1f1b", "pp-1f1b-untied")
PIPELINES = ("pp-1f1b", "pp-zbv", "torch-pp-1f1b", "pp-1f1b-untied")
LAMINA_PIPELINES = ("pp-1f1b", "pp-zbv", "pp-1f1b-untied")
VOCAB, SEQ, WIDTH, LAYERS, HEADS = 8192, 64, 512, 8, 8
GLOBAL_BATCH, MICROBATCHES = 16, 4


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(VOCAB, SEQ, WIDTH, LAYERS, HEADS))


def build_untied() -> GPT:
    """The GPT with the head its own copy of the embedding (what the hand split trains)."""
    model = build()
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    return model


def batch(step: int, replica: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 97 + replica)
    idx = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


class _HandStage(nn.Module):
    """Half of the GPT, as a hand-written torch pipelining split."""

    def __init__(self, model: GPT, first: bool) -> None:
        super().__init__()
        half = LAYERS // 2
        self.first = first
        self.blocks = nn.ModuleList(model.blocks[:half] if first else model.blocks[half:])
        if first:
            self.tok, self.pos, self.drop = model.tok, model.pos, model.drop
        else:
            self.ln_f, self.head = model.ln_f, nn.Linear(WIDTH, VOCAB, bias=False)
            self.head.weight = nn.Parameter(model.head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok(x) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        if not self.first:
            x = self.head(self.ln_f(x))
        return x


class _TorchPipeline:
    """torch pipelining's own 1F1B over a hand split, DDP inside each stage's host."""

    def __init__(self, runtime: lamina.Runtime) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        ranks = runtime.mesh.torch_mesh.mesh  # hosts x ranks of a host
        if runtime.mesh.axis_names.index("inter") != 0:
            ranks = ranks.T
        self.stage_index = runtime.mesh.coordinates()["inter"]
        pp_groups = ranks.T.tolist()  # a pipeline: one rank of each host
        dp_groups = ranks.tolist()  # a stage's replicas: the ranks of a host
        self.pp_group = _mine(pp_groups, runtime.rank)
        dp_group = _mine(dp_groups, runtime.rank)
        module = _HandStage(build(), first=self.stage_index == 0)
        self.module = DDP(module, process_group=dp_group)
        stage = PipelineStage(self.module, self.stage_index, 2, runtime.device, group=self.pp_group)
        self.schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=lm_loss, scale_grads=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.stage_index == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=[])


def _mine(groups: list[list[int]], rank: int) -> dist.ProcessGroup:
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def _tx_bytes() -> int:
    """Bytes this emulated host has sent over its link (its eth0 counter)."""
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return 0


def _stage_seconds(model: nn.Module) -> float:
    """The slowest stage's measured forward + backward of one microbatch (the cut's)."""
    return max(model.lamina_pp.cut.seconds)  # type: ignore[union-attr]


def _predicted_step(runtime: lamina.Runtime, model: Any) -> dict[str, float]:
    """``lamina plan --simulate``'s step for the pipelined ``model`` on this cluster as its
    links were probed (2 hosts x 2 ranks, the mesh's ``inter`` x ``intra``)."""
    from lamina.simulate import cluster_from_dict, predict

    topology = runtime.topology
    inter, intra = topology.link(0, 1), topology.link(0, 2)  # across hosts; inside host 0
    cluster = cluster_from_dict(
        {
            "hosts": 2,
            "devices_per_host": 2,
            "intra": {"bandwidth_gbps": intra.bandwidth_gbps, "latency_us": intra.latency_us},
            "inter": {"bandwidth_gbps": inter.bandwidth_gbps, "latency_us": inter.latency_us},
            "mesh": {"inter": 2, "intra": 2},
        },
        "the probed emulated cluster",
    )
    prediction = predict(model.execution_plan, cluster)
    assert prediction.pipeline is not None
    return {
        "step_s": prediction.step_s,
        "schedule_s": prediction.pipeline.schedule_s,
        "bubble": prediction.pipeline.bubble,
        "collectives_s": prediction.total_s,
    }


def run(args: Any) -> None:
    torch.set_num_threads(1)
    runtime = lamina.init(mesh="topology")
    coords = runtime.mesh.coordinates()
    hosts = runtime.mesh.size("inter")
    replica_pp, replicas_pp = coords["intra"], runtime.mesh.size("intra")
    per_pipeline = GLOBAL_BATCH // replicas_pp
    per_rank = GLOBAL_BATCH // runtime.world_size
    assert hosts == 2, "the benchmark runs on 2 emulated hosts"
    example = batch(0, 0, per_pipeline)[0]
    models: dict[str, Any] = {}
    for variant in VARIANTS:
        if variant in LAMINA_PIPELINES:
            schedule = variant.removeprefix("pp-").removesuffix("-untied")
            models[variant] = lamina.distribute(
                build_untied() if variant.endswith("-untied") else build(), "pp",
                example_inputs=(example,), schedule=schedule, microbatches=MICROBATCHES,
            )  # fmt: skip
        elif variant in ("dp", "hsdp"):
            models[variant] = lamina.distribute(build(), variant)
        elif variant == "ddp":
            models[variant] = DDP(build())
        else:
            models[variant] = _TorchPipeline(runtime)
        if runtime.is_main:
            print(f"  built {variant}", flush=True)
    opts = {
        v: torch.optim.AdamW(
            (m.module if isinstance(m, _TorchPipeline) else m).parameters(), lr=1e-4
        )
        for v, m in models.items()
    }
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    scheduled: dict[str, list[float]] = {v: [] for v in LAMINA_PIPELINES}
    idle: dict[str, list[float]] = {v: [] for v in LAMINA_PIPELINES}
    sent: dict[str, list[int]] = {v: [] for v in VARIANTS}
    step = 0
    for round_ in range(args.rounds + 1):  # round 0 warms up
        k = round_ % len(VARIANTS)
        for variant in [*VARIANTS[k:], *VARIANTS[:k]]:
            model, opt = models[variant], opts[variant]
            for _ in range(args.steps):
                step += 1
                if variant in PIPELINES:
                    x, y = batch(step, replica_pp, per_pipeline)
                else:
                    x, y = batch(step, runtime.rank, per_rank)
                dist.barrier()
                before = _tx_bytes()
                start = time.perf_counter()
                if variant in LAMINA_PIPELINES:
                    model.step(x, y, lm_loss)
                elif variant == "torch-pp-1f1b":
                    model.step(x, y)
                else:
                    lm_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - start
                dist.barrier()
                if round_ > 0:
                    times[variant].append(elapsed)
                    sent[variant].append(_tx_bytes() - before)
                    if variant in LAMINA_PIPELINES:
                        phases = model.lamina_pp.engine.last_phases
                        scheduled[variant].append(phases.schedule_s)
                        idle[variant].append(phases.bubble)
        if runtime.is_main:
            print(f"  round {round_}/{args.rounds} done", flush=True)
    medians = {v: statistics.median(times[v]) for v in VARIANTS}
    host_bytes = {v: statistics.median(sent[v]) if coords["intra"] == 0 else 0 for v in VARIANTS}
    stage_s = {v: _stage_seconds(models[v]) for v in LAMINA_PIPELINES}
    predicted = {v: _predicted_step(runtime, models[v]) for v in LAMINA_PIPELINES}
    schedule_s = {v: statistics.median(scheduled[v]) for v in LAMINA_PIPELINES}
    idle_s = {v: statistics.median(idle[v]) for v in LAMINA_PIPELINES}
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, (medians, host_bytes, stage_s, schedule_s, idle_s, predicted))
    if runtime.is_main:
        _report(args, gathered, models)
    lamina.shutdown()


def _report(args: Any, gathered: list[Any], models: dict[str, Any]) -> None:
    from lamina.strategies.pp.schedules import bubble_fraction, schedule_kind

    step_s = {v: max(g[0][v] for g in gathered) for v in VARIANTS}
    link_bytes = {v: sum(g[1][v] for g in gathered) for v in VARIANTS}
    bubbles: dict[str, dict[str, float]] = {}
    for v in LAMINA_PIPELINES:
        stage = max(g[2][v] for g in gathered)
        schedule = max(g[3][v] for g in gathered)
        kind = schedule_kind(v.removeprefix("pp-").removesuffix("-untied"))
        per = kind.stages_per_rank(2)
        # per rank: m microbatches of each of its stages; stage seconds are per stage
        busy = MICROBATCHES * per * stage
        bubbles[v] = {
            "formula": bubble_fraction(kind, 2, MICROBATCHES, 2),
            "measured": statistics.mean(g[4][v] for g in gathered),
            "measured_per_rank": [g[4][v] for g in gathered],
            "from_cut_times": max(0.0, 1.0 - busy / schedule),
            "from_cut_times_whole_step": max(0.0, 1.0 - busy / step_s[v]),
            "stage_fwd_bwd_s": stage,
            "schedule_s": schedule,
        }
    predicted = {v: gathered[0][5][v] for v in LAMINA_PIPELINES}
    for v, p in predicted.items():
        p["over_measured"] = p["step_s"] / step_s[v]
    best_dp = min(step_s["dp"], step_s["hsdp"])
    ratios = {
        "pp-1f1b_over_best_dp_hsdp": step_s["pp-1f1b"] / best_dp,
        "pp-zbv_over_best_dp_hsdp": step_s["pp-zbv"] / best_dp,
        "pp-1f1b_over_torch-pp-1f1b": step_s["pp-1f1b"] / step_s["torch-pp-1f1b"],
        "pp-1f1b-untied_over_torch-pp-1f1b": step_s["pp-1f1b-untied"] / step_s["torch-pp-1f1b"],
        "pp-1f1b_over_ddp": step_s["pp-1f1b"] / step_s["ddp"],
    }
    print(f"{'variant':15}{'step ms':>10}{'MB over the link':>18}")
    for v in VARIANTS:
        print(f"{v:15}{step_s[v] * 1e3:10.0f}{link_bytes[v] / 1e6:18.1f}")
    for v, b in bubbles.items():
        print(
            f"{v}: bubble measured {b['measured']:.3f} (ranks "
            f"{', '.join(f'{x:.3f}' for x in b['measured_per_rank'])}; from the cut's "
            f"stage times {b['from_cut_times']:.3f}), formula {b['formula']:.3f}"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    for v, p in predicted.items():
        print(
            f"{v}: simulated step {p['step_s'] * 1e3:.0f} ms (schedule "
            f"{p['schedule_s'] * 1e3:.0f}, bubble {p['bubble']:.3f}, collectives "
            f"{p['collectives_s'] * 1e3:.0f}) = {p['over_measured']:.3f}x measured"
        )
    cut = models["pp-1f1b"].step_summary()
    print(cut)
    write_results(
        "emulated_pipeline",
        args.output,
        {
            "link": args.link,
            "world_size": dist.get_world_size(),
            "model": {"vocab": VOCAB, "seq": SEQ, "width": WIDTH, "layers": LAYERS},
            "global_batch": GLOBAL_BATCH,
            "microbatches": MICROBATCHES,
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "median_step_s": step_s,
            "link_bytes_per_step": link_bytes,
            "bubble": bubbles,
            "simulated": predicted,
            "ratios": ratios,
            "cut": cut.splitlines(),
            "gradient_bytes": sum(p.numel() for p in build().parameters()) * 4,
        },
    )


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], "emulated_pipeline.json", ("gpt",))
    parser.add_argument("--link", default="200mbit", help="emulated link speed (200mbit)")
    parser.set_defaults(rounds=3, steps=2)
    args = parser.parse_args()
    if not os.environ.get(INNER_ENV):
        argv = list(sys.argv[1:])
        if "--link" not in argv:
            argv += ["--link", args.link]
        sys.exit(run_emulated(args.link, __file__, argv))
    run(args)


if __name__ == "__main__":
    main()
