"""Pipeline parallelism: ``lamina.distribute(model, "pp", example_inputs=(batch,))``.

The model's chain of blocks is found from one recorded forward (:mod:`.chain`), each
block timed on the device and the chain cut into balanced stages (:mod:`.cut`); each
rank keeps its stages of the one model object (:mod:`.stages`), and a step runs torch's
``torch.distributed.pipelining`` schedule over them (:mod:`.schedules`, :mod:`.engine`):
``loss = model.step(inputs, targets, loss_fn)``. Placed on the ``pp`` axis (by default
the slowest, ``inter``), it replicates over the other axes: each stage's gradients are
averaged across the pipelines. Composed with ``zero3`` or ``hsdp``
(``lamina.distribute(model, ["pp", "zero3"])``), its placement names the ``pp`` axis
alone and the follower shards each stage over the others, gathering it for the whole
step (:mod:`lamina.memory.whole_step`). The plan lists every stage's computes and
transfers (:mod:`.plan_nodes`), the same on every rank, so pre-flight compares the whole
pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.runtime.placement import AxisPlacement, Stage
from lamina.strategies.coalesced import dtype_totals
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import (
    Placement,
    PlannedStep,
    SetupBroadcast,
    StepInputs,
    Strategy,
    StrategyOptions,
)
from lamina.strategies.extension import extend_class
from lamina.strategies.pp.chain import BlockChain, find_chain
from lamina.strategies.pp.cut import (
    BlockCosts,
    RanksTogether,
    StageCut,
    cut_stages,
    measure_costs,
)
from lamina.strategies.pp.engine import PipelineEngine, TiedWeight
from lamina.strategies.pp.layout import PipelineLayout
from lamina.strategies.pp.module import PipelinedModule, Pipelining
from lamina.strategies.pp.options import PipelineOptions
from lamina.strategies.pp.plan_nodes import build_pipeline_plan
from lamina.strategies.pp.schedules import schedule_kind
from lamina.strategies.pp.stages import build_stages

if TYPE_CHECKING:
    from lamina.strategies.compiled.in_graph import InGraphCollectives
    from lamina.strategies.compiled.step import LossFn, StepJob, StepOptions, TrainingStep

#: Mesh axes the pipeline goes on by default, in order of preference.
PP_AXES = ("pp", "inter")


@dataclass(frozen=True)
class StageTimings:
    """What :meth:`PipelineStrategy.measure` found: the chain of blocks and their costs."""

    chain: BlockChain
    costs: BlockCosts


@dataclass(frozen=True)
class PipelinePlanned:
    """What the pipeline's build needs beyond the plan (``PlannedStep.inputs``)."""

    chain: BlockChain
    cut: StageCut
    layout: PipelineLayout
    options: PipelineOptions
    #: Each weight tied across stages: its first name, element count, the stages holding it.
    tie_facts: tuple[tuple[str, int, tuple[int, ...]], ...]
    #: The cut described, a line per stage.
    lines: tuple[str, ...]
    #: The group averaging the pipelines (None: one pipeline, or a sharder syncs them).
    replica_group: dist.ProcessGroup | None


class PipelineStrategy(Strategy):
    """Cuts the model into stages along one mesh axis (see the module)."""

    name = "pp"
    role = "pipeline"
    holds_after = frozenset({"split"})
    eager_step = "loss = model.step(inputs, targets, loss_fn); optimizer.step()"
    summary = "pipeline parallelism: the model cut into stages along the pp axis"
    options = PipelineOptions

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """The ``pp`` axis (else ``inter``; a one-axis mesh: its axis), replicated over
        the others."""
        axes = mesh.axis_names
        axis = next((a for a in PP_AXES if a in axes), axes[0] if len(axes) == 1 else None)
        if axis is None:
            raise ConfigError(
                f"strategy 'pp' needs a mesh axis named 'pp' (or 'inter'); the mesh has "
                f"{list(axes)}; call lamina.init(mesh={{'pp': P, 'dp': D}})"
            )
        return Placement(shard=(axis,), replicate=tuple(a for a in axes if a != axis))

    def measure(
        self, model: nn.Module, ctx: StrategyContext, placement: Placement, options: StrategyOptions
    ) -> StageTimings:
        """The chain of blocks found from one microbatch's forward, and each block's
        forward and backward timed on every rank at once (the ranks agree on each block's
        count of runs, then run them back to back, as every rank computes at once in a
        step); the ranks' mean, so every rank cuts the same stages."""
        assert isinstance(options, PipelineOptions)
        args, kwargs = _microbatch(options, options.microbatches, ctx.device)

        def run() -> Any:
            return model(*args, **kwargs)

        chain = find_chain(model, run)
        costs = measure_costs(model, chain, run, options.timing_runs, RanksTogether(ctx.device))
        return StageTimings(chain, costs)

    def plan(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        inputs: StepInputs | None = None,
    ) -> PlannedStep:
        """The cut from the measured blocks (``inputs.measured``: :meth:`measure`'s) and
        the whole pipeline's plan; no collective."""
        assert isinstance(options, PipelineOptions)
        if len(placement.shard) != 1:
            raise ConfigError(
                f"strategy 'pp' goes on one mesh axis, got placement {placement.describe()}; "
                "use Placement(shard=('pp',), replicate=(...the other axes...))"
            )
        kind = schedule_kind(options.schedule)
        axis = placement.shard[0]
        torch_mesh = ctx.mesh.torch_mesh
        replicate = [ctx.mesh.axis_names.index(a) for a in placement.replicate]
        layout = PipelineLayout.of(
            torch_mesh.mesh, ctx.mesh.axis_names.index(axis), kind, options.virtual_stages,
            ctx.rank, replicate,
        )  # fmt: skip
        timings = inputs.measured if inputs is not None else None
        if not isinstance(timings, StageTimings):
            raise ConfigError(
                "strategy 'pp' plans from its blocks' measured times; distribute the model "
                "with lamina.distribute(model, 'pp', ...), which measures them first"
            )
        chain, costs = timings.chain, timings.costs
        count = layout.stage_count
        holders = [layout.holder(s) for s in range(count)]
        cut = cut_stages(chain, count, costs, options.split_points, holders, options.microbatches)
        lines = _describe(chain, cut, layout)
        ties = _tied(model)
        state = tuple(t for t in (*model.parameters(), *model.buffers()) if not t.is_meta)
        activations = tuple(
            (chain.entry_shapes[s.stop], str(chain.entry_dtype).removeprefix("torch."),
             torch.empty((), dtype=chain.entry_dtype).element_size())
            for s in cut.spans[:-1]
        )  # fmt: skip
        owners = _stage_parameters(model, chain, cut)
        tie_facts = [
            (names[0], param.numel(), tuple(s for s, own in enumerate(owners) if id(param) in own))
            for names, param in ties
        ]
        tie_facts = [t for t in tie_facts if len(t[2]) > 1]
        stage_params = [sum(p.numel() for p in own.values()) for own in owners]
        replica_axis = "+".join(placement.replicate) or "world"
        # pp averages the pipelines only over the axes it replicates: composed, the
        # strategies on the other axes split (tp) or sync (zero3) there
        replica_group = None
        replicas = 1
        if placement.replicate:
            replica_group, replica_ranks = ctx.mesh.group_over(placement.replicate)
            replicas = len(replica_ranks)
        # the whole model from the first rank of the ranks it spans (its own axis and
        # those it replicates over: a strategy applied before, tp, holds the others)
        spanned = (axis, *placement.replicate)
        setup_group, setup_ranks = ctx.mesh.group_over(spanned)
        plan = build_pipeline_plan(
            cut, layout, options.microbatches, activations, stage_params, tie_facts,
            dtype_totals(list(state)), replica_axis, ctx.world_size,
            str(dist.get_backend()) if dist.is_initialized() else "gloo", lines, axis,
            replicas, (setup_ranks, ctx.mesh.axes_label(spanned)),
        )  # fmt: skip
        return PlannedStep(
            model,
            plan,
            (("pipeline_cut", tuple(lines)),),
            SetupBroadcast(state, setup_ranks[0], setup_group),  # before it is cut
            PipelinePlanned(
                chain, cut, layout, options, tuple(tie_facts), tuple(lines), replica_group
            ),
            leading_manifest=(("pipeline_transfers", tuple(_transfer_lines(chain, cut, layout))),),
        )

    def build(self, planned: PlannedStep) -> nn.Module:
        """The model pruned to this rank's stages, with ``step`` running the schedule."""
        held = planned.inputs
        assert isinstance(held, PipelinePlanned)
        chain, cut, layout, options = held.chain, held.cut, held.layout, held.options
        tie_facts, lines, replica_group = held.tie_facts, held.lines, held.replica_group
        model = planned.module
        mine = layout.stages_of(layout.pipeline_rank)
        names_of = {names[0]: tuple(names) for names, _param in _tied(model)}
        runners = build_stages(model, chain, [cut.spans[s] for s in mine])
        pipeline_group = _group_for(layout.pipelines, layout.rank)
        ties = []
        for name, _numel, holders in tie_facts:
            pranks = sorted({layout.holder(s) for s in holders})
            groups = [tuple(p[r] for r in pranks) for p in layout.pipelines]
            group = _group_for(groups, layout.rank) if len(pranks) > 1 else None
            if layout.pipeline_rank in pranks:
                ties.append(TiedWeight(name, names_of[name], group, tuple(pranks)))
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        log = planned.log()
        engine = PipelineEngine(
            runners, layout, options.microbatches, device, pipeline_group, replica_group,
            ties, model, run_log=log,
        )  # fmt: skip
        state = Pipelining(engine, cut, planned.plan, log, planned.preflight, tuple(lines))
        return extend_class(model, PipelinedModule, {}, "lamina_pp", state)

    def compiled_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        settings: StepOptions,
        job: StepJob,
        inside: Sequence[InGraphCollectives] = (),
    ) -> TrainingStep:
        """The pipelined step with every block of this rank's stages compiled, forward
        and backward, and torch's schedule issuing the sends and recvs between them
        (:mod:`.compiled`); stages sharded by ZeRO-3 or HSDP gather as in the eager step."""
        from lamina.strategies.pp.compiled import PipelineCompiledStep

        return PipelineCompiledStep(model, optimizer, loss_fn, settings, job)

    def place_parameters(
        self, model: nn.Module, placement: Placement
    ) -> dict[str, dict[str, AxisPlacement]]:
        """A weight tied across stages: held by every pipeline rank of those stages (the
        others by this rank's stage alone)."""
        held = model.__dict__.get("lamina_pp")
        if held is None:  # not built yet: no stage holds anything apart
            return {}
        axis = placement.shard[0]
        own = {n for n, _ in model.named_parameters()}
        return {
            name: {axis: Stage(tie.holders)}
            for tie in held.engine.ties
            for name in tie.names
            if name in own
        }


def _microbatch(
    options: PipelineOptions, microbatches: int, device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One microbatch of the example inputs, on the device."""
    sizes = [
        t.shape[0]
        for t in pytree.tree_leaves((options.example_inputs, options.example_kwargs))
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    if not sizes or sizes[0] % microbatches:
        raise ConfigError(
            f"strategy 'pp': example_inputs' batch ({sizes[0] if sizes else 'no tensor'}) "
            f"must split into microbatches={microbatches}; give a whole batch of a multiple "
            "of it"
        )
    per = sizes[0] // microbatches

    def cut(t: object) -> object:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == sizes[0]:
            return t[:per].to(device)
        return t

    args = pytree.tree_map(cut, options.example_inputs or ())
    kwargs = pytree.tree_map(cut, options.example_kwargs or {})
    return tuple(args), dict(kwargs)


def _tied(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Parameters registered under two or more names (tied embeddings)."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [(n, params[k]) for k, n in names.items() if len(n) > 1]


def _stage_parameters(
    model: nn.Module, chain: BlockChain, cut: StageCut
) -> list[dict[int, nn.Parameter]]:
    """Each stage's parameters (by identity)."""
    out = []
    for span in cut.spans:
        names = list(chain.blocks[span.start : span.stop])
        if span.is_first:
            names += chain.prefix
        if span.is_last:
            names += chain.suffix
        own = {id(p): p for n in names for p in model.get_submodule(n).parameters()}
        out.append(own)
    return out


def _group_for(groups: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], rank: int) -> Any:
    """This rank's group among ``groups`` (every rank creates every one, in order)."""
    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine


def _transfer_lines(chain: BlockChain, cut: StageCut, layout: PipelineLayout) -> list[str]:
    """Each cut's send and the recv that must match it, as this rank's model makes them:
    compared first by pre-flight, so that a stage whose output another rank's next stage
    does not expect (a hidden size set differently) is named before any transfer."""
    dtype = str(chain.entry_dtype).removeprefix("torch.")
    return [
        f"send stage {s.index} -> recv stage {s.index + 1} (pipeline rank "
        f"{layout.holder(s.index)} -> {layout.holder(s.index + 1)}): "
        f"{list(chain.entry_shapes[s.stop])} {dtype} per microbatch"
        for s in cut.spans[:-1]
    ]


def _describe(chain: BlockChain, cut: StageCut, layout: PipelineLayout) -> list[str]:
    """One line per stage: blocks, pipeline rank, predicted time, bytes crossing after."""
    lines = [
        f"pipeline: {layout.schedule.name}, {len(cut.spans)} stage(s) on {layout.size} "
        f"rank(s) x {len(layout.pipelines)} pipeline(s), cut by {cut.source}"
    ]
    for span in cut.spans:
        first, last = chain.blocks[span.start], chain.blocks[span.stop - 1]
        extra = (" + prefix" if span.is_first else "") + (" + suffix" if span.is_last else "")
        crossing = (
            f", sends {cut.crossing_bytes[span.index]:,} B per microbatch"
            if span.index < len(cut.crossing_bytes)
            else ""
        )
        lines.append(
            f"stage {span.index} (pipeline rank {layout.holder(span.index)}): {first}..{last}"
            f"{extra}, {cut.seconds[span.index] * 1e3:.2f} ms fwd+bwd per microbatch{crossing}"
        )
    return lines


__all__ = ["PipelineOptions", "PipelineStrategy"]
