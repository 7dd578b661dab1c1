"""Tensor parallelism: ``lamina.distribute(model, "tp", example_inputs=(batch,))``.

The plan is derived from one recorded forward (:mod:`.derive`; typed in :mod:`.layers`):
column-parallel then row-parallel linears across the region between them (attention by
heads, grouped-query key/value heads included; MLPs), vocabulary-parallel embeddings and
heads, and sequence parallelism between regions. :mod:`.apply` splits the parameters in
place and puts the collectives (:mod:`.activation_ops`) on the layers;
:mod:`.plan_nodes` lists them as the step's plan. Placed on one mesh axis (``tp``), it
composes with ``zero3`` / ``hsdp`` on the others (:mod:`lamina.strategies.compose`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.utils import _pytree as pytree

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.runtime.placement import AxisPlacement, Split
from lamina.strategies.compiled.in_graph import InGraphCollectives
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
from lamina.strategies.tp.activation_ops import TensorGroup
from lamina.strategies.tp.apply import apply_plan
from lamina.strategies.tp.derive import derive_plan
from lamina.strategies.tp.in_graph import TensorParallelInGraph
from lamina.strategies.tp.layers import TensorPlan
from lamina.strategies.tp.module import TensorParallelism, TensorParallelModule
from lamina.strategies.tp.options import TensorParallelOptions
from lamina.strategies.tp.plan_nodes import build_tensor_plan
from lamina.strategies.tp.state import GlobalViews, ParamSplit

#: The mesh axis tensor parallelism goes on by default.
TP_AXIS = "tp"


@dataclass(frozen=True)
class TensorPlanned:
    """What tensor parallelism's build needs beyond the plan (``PlannedStep.inputs``)."""

    #: Which layer is split how.
    layers: TensorPlan
    #: This rank's tp group.
    group: TensorGroup
    #: The job's torch mesh (the state-dict views' meshes are cut from it).
    root: TorchDeviceMesh
    #: The mesh axis tp goes on.
    axis: str


class TensorParallelStrategy(Strategy):
    """Splits layers across the ranks of one mesh axis (see the module)."""

    name = "tp"
    role = "split"
    summary = "tensor parallelism: layers split across the ranks of the tp axis"
    options = TensorParallelOptions

    def default_placement(self, mesh: DeviceMesh) -> Placement:
        """The ``tp`` axis (a one-axis mesh: its axis)."""
        if TP_AXIS in mesh.axis_names:
            return Placement(shard=(TP_AXIS,))
        if len(mesh.axis_names) == 1:
            return Placement(shard=mesh.axis_names)
        raise ConfigError(
            f"strategy 'tp' needs a mesh axis named 'tp' (the mesh has "
            f"{list(mesh.axis_names)}); call lamina.init(mesh={{'fsdp': N, 'tp': M}})"
        )

    def plan(
        self,
        model: nn.Module,
        ctx: StrategyContext,
        placement: Placement,
        options: StrategyOptions,
        inputs: StepInputs | None = None,
    ) -> PlannedStep:
        """The derived layer plan and its collectives on the tp axis; no collective."""
        assert isinstance(options, TensorParallelOptions)
        if len(placement.shard) != 1 or placement.replicate:
            raise ConfigError(
                f"strategy 'tp' goes on one mesh axis, got placement {placement.describe()}; "
                "use Placement(shard=('tp',))"
            )
        group, ranks = ctx.mesh.group_over(placement.shard)
        tp = TensorGroup(group, len(ranks), ranks.index(ctx.rank))
        args: Any = _on_device(options.example_inputs or (), ctx, model)
        kwargs: Any = _on_device(options.example_kwargs or {}, ctx, model)
        given = options.plan
        layers = derive_plan(
            model, args, kwargs, tp.size, sequence_parallel=options.sequence_parallel, given=given
        )
        axis = ctx.mesh.axes_label(placement.shard)
        backend = str(dist.get_backend(group))
        plan = build_tensor_plan(layers, model, ranks, axis, ctx.world_size, backend)
        state = tuple(t for t in (*model.parameters(), *model.buffers()) if not t.is_meta)
        return PlannedStep(
            model,
            plan,
            (("tensor_plan", layers.lines()),),
            SetupBroadcast(state, 0, None),  # the whole model, before it is split
            TensorPlanned(layers, tp, ctx.mesh.torch_mesh, placement.shard[0]),
        )

    def build(self, planned: PlannedStep) -> nn.Module:
        """The model itself, split in place as the plan says."""
        held = planned.inputs
        assert isinstance(held, TensorPlanned)
        layers, tp, root, axis = held.layers, held.group, held.root, held.axis
        model = planned.module
        applied = apply_plan(model, layers, tp, planned.log())
        splits = {n: ParamSplit(*split) for n, split in applied.splits.items()}
        views = GlobalViews(splits, tp)
        views.attach(root, axis, None)
        state = TensorParallelism(
            layers,
            tp,
            planned.plan,
            planned.log(),
            planned.preflight,
            views,
            applied.heads,
            step_log=applied.log,
        )
        return extend_class(model, TensorParallelModule, {}, "lamina_tp", state)

    def in_graph(self, model: nn.Module) -> InGraphCollectives | None:
        """The activation collectives, traced into the step's graph with the forward
        (:class:`~lamina.strategies.tp.in_graph.TensorParallelInGraph`)."""
        held = model.__dict__.get("lamina_tp")
        if not isinstance(held, TensorParallelism):
            return None
        return TensorParallelInGraph(held, model)

    def place_parameters(
        self, model: nn.Module, placement: Placement
    ) -> dict[str, dict[str, AxisPlacement]]:
        """Each parameter the plan cut: split on its dim across the tp axis (the others
        stay whole on every tp rank)."""
        held = model.__dict__.get("lamina_tp")
        if held is None:  # not built yet: nothing is cut
            return {}
        axis = placement.shard[0]
        return {
            name: {axis: Split(split.dim % len(split.full_shape), split.parts)}
            for name, split in held.views.splits.items()
        }


def _on_device(value: object, ctx: StrategyContext, model: nn.Module) -> object:
    """Example inputs moved to the model's device (meta for a model built there: the
    plan is derived from shapes alone)."""
    on_meta = any(p.is_meta for p in model.parameters())
    device = torch.device("meta") if on_meta else ctx.device

    def move(t: object) -> object:
        return t.to(device) if isinstance(t, torch.Tensor) else t

    return pytree.tree_map(move, value)


__all__ = ["TensorParallelOptions", "TensorParallelStrategy", "TensorPlan"]
