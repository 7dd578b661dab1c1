"""Expert parallelism: ``lamina.distribute(model, ["ep", "zero3"], example_inputs=(batch,))``.

The MoE layers are found by one forward of the example batch (:mod:`.find`); each layer's
experts module is replaced by one holding this rank's ``experts / ep`` experts
(:mod:`.layer`), reached by a token dispatcher (:mod:`.dispatch`, a plugin point). Every
rank of the ep axis trains on its own batch (the axis is a data axis), so dense
parameters stay whole there and their gradients are averaged over it, while an expert's
gradient already gathers every rank's tokens (:mod:`.grad_sync`). A sharder composed
after ep shards each rank's pieces over the other axes (``zero3`` over ``dp_shard``),
experts and dense layers alike. The router's load-balancing loss is computed over the
global batch (:mod:`.aux_loss`). In ``state_dict()`` the experts are whole-tensor
``DTensor``\\ s, so DCP checkpoints load across ep degrees and into one process.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from lamina.device.mesh import DeviceMesh
from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.runtime.placement import AxisPlacement, Role, Split
from lamina.runtime.render import EXPERT_STEP
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
from lamina.strategies.ep.aux_loss import BalanceGroup, use_global_balance_loss
from lamina.strategies.ep.dispatch import ExpertGroup
from lamina.strategies.ep.find import MoeLayer, find_moe_layers, stacked_modules
from lamina.strategies.ep.grad_sync import ExpertGradientSync, SyncGroup
from lamina.strategies.ep.layer import DispatchedExperts, check_replaceable
from lamina.strategies.ep.measure import ExpertMeasured, measure_on_job
from lamina.strategies.ep.module import ExpertParallelism, ExpertParallelModule
from lamina.strategies.ep.options import ExpertParallelOptions
from lamina.strategies.ep.plan_nodes import ExpertPlanInput, PlanGroup, build_expert_plan
from lamina.strategies.ep.registry import resolve_dispatcher
from lamina.strategies.extension import extend_class
from lamina.strategies.surface import STEP_SYNCS_KEY, placed_before
from lamina.strategies.tp import _on_device
from lamina.strategies.tp.activation_ops import StepLog, TensorGroup
from lamina.strategies.tp.state import GlobalViews, ParamSplit

#: The mesh axis expert parallelism goes on by default.
EP_AXIS = "ep"
#: The expert weights of a layer, by attribute.
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class _Groups:
    ep: tuple[dist.ProcessGroup | None, tuple[int, ...]]
    dense: tuple[dist.ProcessGroup | None, tuple[int, ...]]
    replicas: tuple[dist.ProcessGroup | None, tuple[int, ...]]
    balance: tuple[dist.ProcessGroup | None, tuple[int, ...]] | None


@dataclass(frozen=True)
class ExpertPlanned:
    """What expert parallelism's build needs beyond the plan."""

    layers: tuple[MoeLayer, ...]
    groups: _Groups
    dispatcher: str
    root: Any
    axis: str


class ExpertParallelStrategy(Strategy):
    """Spreads each MoE layer's experts over the ranks of one mesh axis (see the module)."""

    name = "ep"
    role = "split"
    holds_after = frozenset({"split"})
    joins_split = True
    summary = "expert parallelism: each MoE layer's experts spread over the ranks of the ep axis"
    options = ExpertParallelOptions
    eager_step = "loss = model(batch, labels=labels).loss; loss.backward(); optimizer.step()"

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """The ``ep`` axis (a one-axis mesh: its axis), replicated over the others."""
        return named_axis_placement(mesh, EP_AXIS, self.name)

    def roles(self, placement: Placement) -> tuple[Role, ...]:
        """``split`` of the experts over the ep axis, which is a data axis (each rank its
        own batch), and ``replicate`` over the replica axes."""
        declared = [Role(self.name, "split", placement.shard, data=True)]
        if placement.replicate:
            declared.append(Role(self.name, "replicate", placement.replicate, data=True))
        return tuple(declared)

    def place_parameters(
        self, model: nn.Module, placement: Placement
    ) -> dict[str, dict[str, AxisPlacement]]:
        """Every expert weight split in rows (experts) over the ep axis; the rest whole."""
        held = model.__dict__.get("lamina_ep")
        names = (
            [layer.name for layer in held.layers]
            if isinstance(held, ExpertParallelism)
            else list(stacked_modules(model))
        )
        return {
            f"{module}.{weight}": {axis: Split(0) for axis in placement.shard}
            for module in names
            for weight in EXPERT_WEIGHTS
        }

    def _layers(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: ExpertParallelOptions,
    ) -> tuple[tuple[MoeLayer, ...], Callable[[], Any]]:
        """The MoE layers (one forward of the example batch) and that forward; a one-line
        ConfigError for what ep cannot take, before any collective."""
        if len(placement.shard) != 1:
            raise ConfigError(
                f"strategy 'ep' goes on one mesh axis, got placement {placement.describe()}; "
                "use Placement(shard=('ep',))"
            )
        if not options.example_inputs and not options.example_kwargs:
            raise ConfigError(
                "strategy 'ep' finds the MoE layers from one forward: pass "
                "example_inputs=(batch,) (a batch of the training shape)"
            )
        resolve_dispatcher(options.dispatcher)
        size = ctx.mesh.size(placement.shard[0])
        args: Any = _on_device(options.example_inputs or (), ctx, model)
        kwargs: Any = _on_device(dict(options.example_kwargs or {}), ctx, model)

        def run() -> Any:
            return model(*args, **kwargs)

        layers = find_moe_layers(model, run)
        for layer in layers:
            check_replaceable(layer.name, model.get_submodule(layer.name))
            ExpertGroup(None, size, 0, layer.experts)  # one line unless ep divides
        return layers, run

    def measure(
        self, model: nn.Module, ctx: StrategyContext, placement: Placement, options: StrategyOptions
    ) -> Any:
        """A rank's step timed and the example batch's routing gathered (:mod:`.measure`;
        collective: every rank)."""
        assert isinstance(options, ExpertParallelOptions)
        layers, run = self._layers(model, ctx, placement, options)
        group, ranks = ctx.mesh.group_over(placement.shard)
        return measure_on_job(model, run, layers, group, len(ranks), ctx.handle.synchronize)

    def plan(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        inputs: StepInputs | None = None,
    ) -> PlannedStep:
        """The MoE layers, their exchanges and the gradient sync (no collective)."""
        assert isinstance(options, ExpertParallelOptions)
        measured = inputs.measured if inputs is not None else None
        if isinstance(measured, ExpertMeasured):
            layers = measured.layers
        else:
            layers, _ = self._layers(model, ctx, placement, options)
        mesh = ctx.mesh
        ep_group, ep_ranks = mesh.group_over(placement.shard)
        data_axes = options.data_axes or (*placement.shard, *placement.replicate)
        dense_axes = (*placement.shard, *placement.replicate)
        balanced = (
            options.global_aux_loss
            and bool(getattr(getattr(model, "config", None), "output_router_logits", False))
            and use_global_balance_loss(model)
        )
        groups = _Groups(
            (ep_group, ep_ranks),
            mesh.group_over(dense_axes),
            mesh.group_over(placement.replicate) if placement.replicate else (None, (ctx.rank,)),
            mesh.group_over(data_axes) if balanced else None,
        )
        expert_names = {f"{layer.name}.{w}" for layer in layers for w in EXPERT_WEIGHTS}
        dense_numel: dict[str, int] = {}
        expert_numel: dict[str, int] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                into = expert_numel if name in expert_names else dense_numel
                share = len(ep_ranks) if name in expert_names else 1
                into[dtype_name(p.dtype)] = into.get(dtype_name(p.dtype), 0) + p.numel() // share
        data_size = len(mesh.group_over(data_axes)[1])
        # the whole model from rank 0, unless a split applied before (tp) already made the
        # ranks agree and cut it: its pieces differ across its axis
        held_before = placed_before(model, self.name)
        state = tuple(t for t in (*model.parameters(), *model.buffers()) if not t.is_meta)
        setup: dict[str, int] = {}
        for t in () if held_before else state:
            setup[dtype_name(t.dtype)] = setup.get(dtype_name(t.dtype), 0) + t.numel()
        axis = mesh.axes_label(placement.shard)
        plan = build_expert_plan(
            ExpertPlanInput(
                layers,
                PlanGroup(ep_ranks, axis),
                PlanGroup(groups.dense[1], mesh.axes_label(dense_axes)),
                PlanGroup(
                    groups.replicas[1],
                    mesh.axes_label(placement.replicate) if placement.replicate else "",
                ),
                PlanGroup(groups.balance[1], mesh.axes_label(data_axes))
                if groups.balance
                else None,
                dense_numel,
                expert_numel,
                tuple(sorted(setup.items())) if ctx.world_size > 1 else (),  # before the cut
                ctx.world_size,
                str(dist.get_backend(ep_group)),
                max(1, data_size // len(groups.dense[1])),
                _exchanged(measured, len(ep_ranks)),
            ),
            meta=(
                ("dispatcher", options.dispatcher),
                *(
                    ((EXPERT_STEP, f"{measured.step_s:.6g}"),)
                    if isinstance(measured, ExpertMeasured)
                    else ()
                ),
            ),
        )
        lines = (
            f"ep={len(ep_ranks)} on {axis}, dispatcher {options.dispatcher}, global "
            f"load-balancing loss {balanced}",
            *(layer.describe() for layer in layers),
        )
        return PlannedStep(
            model,
            plan,
            (("expert_plan", lines),),
            None if held_before else SetupBroadcast(state, 0, None),
            ExpertPlanned(layers, groups, options.dispatcher, mesh.torch_mesh, placement.shard[0]),
        )

    def build(self, planned: PlannedStep) -> nn.Module:
        """The model itself, each MoE layer's experts cut to this rank's."""
        held = planned.inputs
        assert isinstance(held, ExpertPlanned)
        model = planned.module
        log = StepLog(planned.log())
        group, ranks = held.groups.ep
        index = ranks.index(dist.get_rank())
        dispatcher = resolve_dispatcher(held.dispatcher)
        splits: dict[str, ParamSplit] = {}
        modules = []
        for number, layer in enumerate(held.layers):
            original = model.get_submodule(layer.name)
            ep = ExpertGroup(group, len(ranks), index, layer.experts)
            for weight in EXPERT_WEIGHTS:
                whole = getattr(original, weight)
                splits[f"{layer.name}.{weight}"] = ParamSplit(
                    0, (layer.experts,), tuple(whole.shape)
                )
            replaced = DispatchedExperts(original, ep, dispatcher, number, log.issuing)
            _set_submodule(model, layer.name, replaced)
            modules.append(replaced)
        views = GlobalViews(splits, TensorGroup(group, len(ranks), index))
        views.attach(held.root, held.axis, None)
        dense_group, dense_ranks = held.groups.dense
        replica_group, replica_ranks = held.groups.replicas
        sync = ExpertGradientSync(
            weakref.ref(model),
            frozenset(splits),
            len(ranks),
            SyncGroup(dense_group, len(dense_ranks)),
            SyncGroup(replica_group, len(replica_ranks)),
            log.issuing,
        )
        for module in modules:
            module.on_backward = sync.queue
        model.__dict__[STEP_SYNCS_KEY] = (
            sync.run_after_step,
        )  # a pipeline composed after ep runs it
        balance = None
        if held.groups.balance is not None:
            balance_group, balance_ranks = held.groups.balance
            balance = BalanceGroup(balance_group, len(balance_ranks), log.issuing)
        state = ExpertParallelism(
            held.layers,
            tuple(modules),
            held.dispatcher,
            len(ranks),
            planned.plan,
            planned.log(),
            log,
            planned.preflight,
            views,
            sync,
            balance,
        )
        return extend_class(model, ExpertParallelModule, {}, "lamina_ep", state)


def _exchanged(measured: Any, size: int) -> tuple[int, ...]:
    """Per layer, the assignments the plan sizes a rank's token exchange for: the mean
    rank's off-rank share of the measured routing, as a whole exchange (``size / (size -
    1)`` of it); empty without a measurement."""
    if not isinstance(measured, ExpertMeasured) or size < 2:
        return ()
    return tuple(-(-b * size // (size - 1)) for b in measured.exchanged)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


__all__ = ["EP_AXIS", "ExpertParallelStrategy"]
