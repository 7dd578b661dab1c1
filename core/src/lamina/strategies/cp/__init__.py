"""Context parallelism: ``lamina.distribute(model, ["cp", "zero3"], example_inputs=(batch,))``.

The sequence of every input is split across the ranks of the ``cp`` axis (each rank a
head and a tail chunk, :mod:`.layout`); the model's position calls get the global
positions of the rank's tokens (:mod:`.probe`), each attention call runs across the
ranks (:mod:`.attention`: all-gather, pass-KV ring or all-to-all over heads, chosen per
call by :mod:`.choose`), and the outputs are gathered back, so the loop's loss is the
one-process loss. Parameters stay whole on the cp axis (role ``split`` of activations
only), so a sharder composed after cp spans the cp axis too (``zero3`` over
``dp_shard x cp``, as FSDP2 does under torchtitan's context parallelism); alone, cp
averages the gradients over its axis and the replica axes after backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.cost import AlgorithmChoice, CostModel
from lamina.device.mesh import DeviceMesh
from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.runtime.plan import meta_items
from lamina.strategies.algorithm_choice import choose_algorithms, group_cost_model
from lamina.strategies.algorithm_nodes import algorithm_fact
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import (
    Placement,
    PlannedStep,
    SetupBroadcast,
    StepInputs,
    Strategy,
    StrategyOptions,
    named_axis_placement,
)
from lamina.strategies.cp.choose import Priced, Timed, measure_on_job, ulysses_refusal
from lamina.strategies.cp.choose import choose_algorithms as choose_attention
from lamina.strategies.cp.comm import ContextGroup
from lamina.strategies.cp.hf import is_transformers_model, use_context_attention
from lamina.strategies.cp.layout import SequenceLayout
from lamina.strategies.cp.local_step import local_step
from lamina.strategies.cp.module import (
    ContextParallelism,
    ContextParallelModule,
    GradientSync,
    accepts,
)
from lamina.strategies.cp.options import ContextParallelOptions
from lamina.strategies.cp.plan_nodes import build_context_plan, compute_meta
from lamina.strategies.cp.probe import Probed, probe_forward
from lamina.strategies.extension import extend_class
from lamina.strategies.surface import placed_before
from lamina.strategies.tp import _on_device
from lamina.strategies.tp.activation_ops import StepLog

#: The mesh axis context parallelism goes on by default.
CP_AXIS = "cp"


@dataclass(frozen=True)
class ContextPlanned:
    """What context parallelism's build needs beyond the plan."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    layout: SequenceLayout
    probed: Probed
    priced: tuple[Priced, ...]
    dim: int
    transformers: bool
    sync: tuple[dist.ProcessGroup | None, tuple[int, ...]] | None
    #: Per dtype name, the gradient all-reduce's algorithm and chunks (cp alone).
    sync_algorithms: dict[str, tuple[str, int]]
    #: The sync group's cost model (its host layout builds the algorithms' groups).
    sync_cost: CostModel | None
    backend: str


@dataclass(frozen=True)
class _Measured:
    probed: Probed
    timed: Timed


class ContextParallelStrategy(Strategy):
    """Splits the sequence across the ranks of one mesh axis (see the module)."""

    name = "cp"
    role = "split"
    holds_after = frozenset({"split"})
    shares_axes = True
    summary = "context parallelism: the sequence split across the ranks of the cp axis"
    options = ContextParallelOptions
    eager_step = "loss = loss_fn(model(batch), targets); loss.backward(); optimizer.step()"

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """The ``cp`` axis (a one-axis mesh: its axis), replicated over the others."""
        return named_axis_placement(mesh, CP_AXIS, self.name)

    def _setup(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: ContextParallelOptions,
    ) -> tuple[SequenceLayout, Any, Any, bool]:
        if len(placement.shard) != 1:
            raise ConfigError(
                f"strategy 'cp' goes on one mesh axis, got placement {placement.describe()}; "
                "use Placement(shard=('cp',))"
            )
        if not options.example_inputs and not options.example_kwargs:
            raise ConfigError(
                "strategy 'cp' plans from a batch of the training shape: pass "
                "example_inputs=(batch,) (whole sequences, as every step will get)"
            )
        _, ranks = ctx.mesh.group_over(placement.shard)
        args: Any = _on_device(options.example_inputs or (), ctx, model)
        kwargs: Any = _on_device(dict(options.example_kwargs or {}), ctx, model)
        first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)), None)
        if first is None or first.dim() <= options.seq_dim:
            raise ConfigError(
                f"strategy 'cp': the first example input has no dim {options.seq_dim} to split; "
                "pass example_inputs=(tokens,) shaped (batch, sequence, ...) or set seq_dim="
            )
        layout = SequenceLayout(
            int(first.shape[options.seq_dim]),
            len(ranks),
            ranks.index(ctx.rank),
            options.load_balance,
        )
        transformers = is_transformers_model(model)
        if transformers:
            use_context_attention(model)
        return layout, args, kwargs, transformers

    def measure(
        self, model: nn.Module, ctx: StrategyContext, placement: Placement, options: StrategyOptions
    ) -> Any:
        """The probe of the forward (:mod:`.probe`) and one attention block timed, the
        slowest rank's (collective: every rank)."""
        assert isinstance(options, ContextParallelOptions)
        layout, args, kwargs, transformers = self._setup(model, ctx, placement, options)
        probed = _probe(model, layout, args, kwargs, options.seq_dim, transformers)
        _check_requested(probed, layout, options.attention)
        group, ranks = ctx.mesh.group_over(placement.shard)
        step = local_step(
            model,
            layout,
            args,
            kwargs,
            options.seq_dim,
            _extra_kwargs(model, transformers)(layout.positions()),
            group if len(ranks) > 1 else None,
        )
        timed = measure_on_job(probed.sites[0], layout, ctx.device, step)
        return _Measured(probed, timed)

    def plan(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        inputs: StepInputs | None = None,
    ) -> PlannedStep:
        """The attention calls, their algorithms and collectives on the cp axis."""
        assert isinstance(options, ContextParallelOptions)
        layout, args, kwargs, transformers = self._setup(model, ctx, placement, options)
        measured = inputs.measured if inputs is not None else None
        if isinstance(measured, _Measured):
            probed, timed = measured.probed, measured.timed
        else:
            probed = _probe(model, layout, args, kwargs, options.seq_dim, transformers)
            timed = Timed(0.0, 0.0, 0.0)
        block_s = timed.block_forward_s
        _check_requested(probed, layout, options.attention)
        group, ranks = ctx.mesh.group_over(placement.shard)
        cost = CostModel.from_topology(ctx.topology, ranks)
        link = cost.inter if cost.layout.host_count > 1 else cost.intra
        priced = choose_attention(probed.sites, layout, link, block_s, options.attention)
        sync = None
        sync_label = None
        sync_choices: dict[str, AlgorithmChoice] = {}
        backend = str(dist.get_backend(group))
        if options.sync_gradients:
            axes = (*placement.shard, *placement.replicate)
            sync_group, sync_ranks = ctx.mesh.group_over(axes)
            sync = (sync_group, sync_ranks)
            sync_label = (sync_ranks, ctx.mesh.axes_label(axes))
            sync_choices = choose_algorithms(
                group_cost_model(ctx.topology, sync_ranks),
                gradient_bytes(model),
                "auto",
                pg_backend=backend,
                whole_job=len(sync_ranks) == ctx.world_size,
            )
        axis = ctx.mesh.axes_label(placement.shard)
        meta = (
            *meta_items(
                tokens=layout.length,
                tokens_per_rank=layout.local_length,
                load_balanced=layout.balanced,
            ),
            *compute_meta(timed, layout, probed.sites),
            *((f"attention {p.site}", p.describe().split(": ", 1)[1]) for p in priced),
        )
        plan = build_context_plan(
            probed.sites,
            tuple(p.algorithm for p in priced),
            probed.outputs,
            layout.local_length,
            model,
            ranks,
            axis,
            ctx.world_size,
            backend,
            sync_label,
            meta,
            broadcast=not placed_before(model, self.name),
            sync_algorithms={
                k: f for k, c in sync_choices.items() if (f := algorithm_fact(c)) is not None
            },
        )
        lines = (
            f"sequence {layout.length} over cp={layout.size}, balanced={layout.balanced}",
            *(p.describe().split(" (")[0] for p in priced),
            *(f"{s.describe()}" for s in probed.sites),
        )
        state = tuple(t for t in (*model.parameters(), *model.buffers()) if not t.is_meta)
        # the whole model from rank 0, unless a strategy applied before (tp) already made
        # the ranks agree and cut it: its pieces differ across its axis
        held_before = placed_before(model, self.name)
        return PlannedStep(
            model,
            plan,
            (("context_plan", lines),),
            None if held_before else SetupBroadcast(state, 0, None),
            ContextPlanned(
                group,
                ranks,
                layout,
                probed,
                priced,
                options.seq_dim,
                transformers,
                sync,
                {k: (c.algorithm, c.chunks) for k, c in sync_choices.items()},
                group_cost_model(ctx.topology, sync[1]) if sync else None,
                backend,
            ),
        )

    def build(self, planned: PlannedStep) -> nn.Module:
        """The model itself, its forward context-parallel."""
        held = planned.inputs
        assert isinstance(held, ContextPlanned)
        log = StepLog(planned.log())
        group = ContextGroup(
            held.group, held.ranks, held.ranks.index(dist.get_rank()), log, held.layout
        )
        model = planned.module
        sync = None
        if held.sync is not None:
            params = [p for p in model.parameters() if p.requires_grad]
            used = {a for a, _ in held.sync_algorithms.values()}
            groups = None
            if used - {"flat"} and held.sync_cost is not None:
                # every rank builds them, in one order, after pre-flight agreed on the plan
                groups = AlgorithmGroups(
                    held.sync_cost.layout,
                    dist.get_rank(),
                    flat=held.sync[0],
                    pg_backend=held.backend,
                    whole_job=len(held.sync[1]) == dist.get_world_size(),
                    needed=used,
                )
            sync = GradientSync(params, held.sync[0], group, held.sync_algorithms, groups)
        extra = _extra_kwargs(model, held.transformers)
        state = ContextParallelism(
            group,
            held.probed.sites,
            tuple(p.algorithm for p in held.priced),
            held.probed.positional,
            planned.plan,
            planned.log(),
            planned.preflight,
            held.dim,
            lambda positions: extra(positions),
            sync,
        )
        state.watch(model)
        return extend_class(model, ContextParallelModule, {}, "lamina_cp", state)


def gradient_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the trainable parameters' gradients, per dtype name."""
    totals: dict[str, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            name = dtype_name(p.dtype)
            totals[name] = totals.get(name, 0) + p.numel() * p.element_size()
    return totals


def _check_requested(probed: Probed, layout: SequenceLayout, attention: str) -> None:
    """A one-line ConfigError when the requested algorithm cannot run a call."""
    if attention != "all_to_all":
        return
    for site in probed.sites:
        refusal = ulysses_refusal(site, layout.size)
        if refusal:
            raise ConfigError(
                f"strategy 'cp': attention='all_to_all' cannot run: {refusal}; use "
                "attention='pass_kv' or 'all_gather' (or 'auto')"
            )


def _extra_kwargs(model: nn.Module, transformers: bool) -> Any:
    """What the forward adds for a transformers model: global position ids (its mask and
    rotary tables read them) and no cache."""
    takes_positions = transformers and accepts(model, "position_ids")
    takes_cache = transformers and accepts(model, "use_cache")

    def extra(positions: torch.Tensor) -> dict[str, Any]:
        added: dict[str, Any] = {}
        if takes_positions:
            added["position_ids"] = positions.unsqueeze(0)
        if takes_cache:
            added["use_cache"] = False
        return added

    return extra


def _probe(
    model: nn.Module, layout: SequenceLayout, args: Any, kwargs: Any, dim: int, transformers: bool
) -> Probed:
    extra = _extra_kwargs(model, transformers)
    return probe_forward(
        model,
        tuple(args),
        dict(kwargs),
        layout.length,
        layout.local_length,
        dim,
        lambda n: extra(torch.arange(n)),
    )


__all__ = ["ContextParallelOptions", "ContextParallelStrategy"]
