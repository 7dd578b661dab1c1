"""The whole ZeRO-3 / HSDP step as one captured graph: :class:`ShardedCompiledStep`.

``lamina.compile_step(model, optimizer, loss_fn)`` on a model distributed with ``zero3``
or ``hsdp`` (the shared machinery: :mod:`lamina.strategies.compiled.step`). The first
call runs the eager step: it records the units' forward order (the plan's
``forward_order``) and which parameters some rank's forward reaches. From the second
call on, one graph per rank holds, read from the plan's nodes:

- each unit's gather, in the plan's forward order, over the shard group, with the
  unit's planned primitive (``all_gather``, the all-reduce form, or one broadcast per
  rank), as functional collectives; the parameters as views of the gathered buffers;
- the forward of the model's own class and the loss (``torch.func.functional_call``),
  and the backward (``torch.func.grad_and_value``);
- each unit's reduce-scatter of its gradient (laid out rank-major as the eager step
  lays it, used-flags included), in the plan's backward order, with its planned
  primitive, averaged; with replicas (HSDP) the all-reduce of the shard gradient across
  them;
- with ``max_norm``, the shards' gradients clipped as
  ``torch.nn.utils.clip_grad_norm_`` clips the whole model's: each rank's part of the
  norm all-reduced over the shard group (plan node ``grad_norm.all_reduce``);
- the optimizer's update of the local shards, torch's own, written into the shard
  buffers the parameters are views of.

The graph keeps each unit gathered from its forward to its backward: the plan's
backward gathers are declared as not taken (a plan fallback on each, with the reason).
Decided before the capture (a plan fallback on the first unit's forward node): an
optimizer whose update is not traced, a parameter no rank's first forward reached,
mixed precision (``param_dtype``), a codec on a unit. A unit the plan gives the
hierarchical algorithm keeps it in the graph: the gather across hosts then inside each,
the reduce-scatter inside each host then across (:class:`~lamina.memory.hierarchy.HostHierarchy`'s
phases and slot order, gloo's forms where it is gloo).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.func import functional_call, grad_and_value

from lamina.memory.engine import UnitState
from lamina.memory.hierarchy import HostHierarchy
from lamina.memory.layout import ParamShard, UnitLayout
from lamina.runtime import Collective, CollectiveSpec, ExecutionPlan, Fallback, PlanNode, RunLog
from lamina.strategies.compiled.functional_optim import UpdatedTensors, trained
from lamina.strategies.compiled.graph_algorithms import (
    gather_calls,
    gather_over,
    scatter_call,
    scatter_over,
)
from lamina.strategies.compiled.graph_collectives import PlannedCall
from lamina.strategies.compiled.in_graph import InGraphCollectives
from lamina.strategies.compiled.step import CompiledStep, LossFn, StepJob, StepOptions
from lamina.strategies.dp.planner import seen_as
from lamina.strategies.zero3.module import ShardedModule
from lamina.strategies.zero3.plan import gather_node, replicate_node, scatter_node

#: What the plan's backward gathers become in the compiled step.
KEPT = "kept gathered from its forward"
#: Plan node of the gradient norm's all-reduce over the shard group (with clipping).
NORM_NODE = "grad_norm.all_reduce"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local shard (the tensor itself when not sharded)."""
    local: torch.Tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local


class ShardedCompiledStep(CompiledStep):
    """``loss = step(*inputs, target)``: one training step of a ``zero3`` or ``hsdp``
    model (see the module docstring); ``model_class`` is the model's own class, which the
    strategy recorded before extending it (built by ``Zero3Strategy.compiled_step``)."""

    clips_in_graph = True

    def __init__(
        self,
        model: ShardedModule,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        options: StepOptions,
        job: StepJob,
        *,
        model_class: type[nn.Module],
        inside: Sequence[InGraphCollectives] = (),
    ) -> None:
        super().__init__(model, optimizer, loss_fn, options, job, inside)
        self.sharded = model
        self.sharding = model.lamina_sharding
        #: The model's class before ``zero3`` extended it (the traced forward is its own),
        #: as the strategy recorded it.
        self.model_class = model_class
        self._warmed = False
        self._unreached: list[str] = []
        self._order: list[UnitState] = []

    # -- the plan ------------------------------------------------------------------------
    @property
    def plan(self) -> ExecutionPlan | None:
        """The model's execution plan."""
        return self.sharding.execution_plan

    def _set_plan(self, plan: ExecutionPlan) -> None:
        self.sharding.execution_plan = plan
        self.sharding.run_log.plan = plan

    @property
    def run_log(self) -> RunLog:
        """The model's run log."""
        return self.sharding.run_log

    @property
    def step_node(self) -> str:
        """The first unit's forward node."""
        plan = self.plan
        assert plan is not None
        return next(n.id for n in plan.nodes if n.kind == "forward")

    @property
    def _engine_units(self) -> dict[str, UnitState]:
        engine = self.sharding.engine
        assert engine is not None
        return {u.layout.name: u for u in engine.units}

    def _warm_up(self, inputs: list[Any], target: Any) -> torch.Tensor | None:
        """The first call: the eager step, which records the units' order and which
        parameters some rank reached; then the gradients are dropped (the graph keeps its
        own)."""
        if self._warmed:
            return None
        loss = self.eager_step(inputs, target)
        self._unreached = [
            n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None
        ]
        self.optimizer.zero_grad(set_to_none=True)
        self._warmed = True
        plan = self.plan
        assert plan is not None
        units = self._engine_units
        self._order = [units[n.unit] for n in plan.nodes if n.id == gather_node(n.unit, "fwd")]
        return loss

    def _plan_fallback_cases(self) -> str:
        return (
            "the optimizer's update is not traced, a parameter is unreached, mixed "
            "precision, or a unit has a codec"
        )

    def _plan_time_reason(self, plan: ExecutionPlan) -> str:
        if self._unreached:
            return (
                f"{len(self._unreached)} parameter(s) no rank's forward reached at step 1 "
                f"({self._unreached[0]}, ...): the eager step leaves their gradient None"
            )
        if self.sharding.param_dtype is not None:
            return "mixed precision (param_dtype) gathers in another dtype"
        for unit in self._order:
            if unit.config.codec is not None:
                return f"unit {unit.layout.name} has codec {unit.config.codec.name}"
        return ""

    def _declared_plan(self, plan: ExecutionPlan, fallbacks: list[Fallback]) -> ExecutionPlan:
        """The step's fallbacks, and each backward gather declared as not run."""
        declared = super()._declared_plan(plan, fallbacks)
        compiled = not self.eager_reason
        kept = [
            Fallback(
                n.id,
                "gather again for backward",
                KEPT,
                "compile_step: the graph keeps the unit's parameters from its forward",
                when="plan",
                taken=compiled,
                reason="the captured step holds each gathered unit until its backward"
                if compiled
                else "",
            )
            for n in plan.nodes
            if n.id == gather_node(n.unit, "bwd")
        ]
        declared = dataclasses.replace(declared, fallbacks=(*declared.fallbacks, *kept))
        if compiled and self._clips_over_ranks():
            declared = _with_norm_node(declared, self._order[0], 1 + len(self.inside))
        if compiled and self.options.max_norm is not None:
            for composed in self.inside:
                declared = _with_split_norm_node(declared, composed)
        return declared

    def _clips_over_ranks(self) -> bool:
        """Whether the graph all-reduces the gradient norm (clipping, several shards)."""
        return self.options.max_norm is not None and self._order[0].layout.world_size > 1

    def _now_eager(self) -> None:
        """The eager step gathers again for backward: the plan's backward gathers run."""
        plan = self.plan
        assert plan is not None
        fallbacks = tuple(
            dataclasses.replace(f, taken=False, reason="")
            if f.alternative == KEPT and f.when == "plan"
            else f
            for f in plan.fallbacks
        )
        self._set_plan(dataclasses.replace(plan, fallbacks=fallbacks))

    # -- the collectives the graph issues ---------------------------------------------------
    def _gather_calls(self, unit: UnitState) -> list[PlannedCall]:
        layout, node = unit.layout, gather_node(unit.layout.name, "fwd")
        if layout.world_size == 1:
            return []
        hierarchy = unit.config.hierarchy
        if hierarchy is not None:  # across the hosts, then inside each
            hosts, local, size = (
                len(hierarchy.inter_ranks),
                len(hierarchy.intra_ranks),
                layout.shard_numel,
            )
            return [
                *gather_calls(node, hosts, size, hierarchy.native),
                *gather_calls(node, local, hosts * size, hierarchy.native),
            ]
        if unit.primitive == "broadcast":
            return [PlannedCall(node, "broadcast", layout.shard_numel)] * layout.world_size
        op = "all_gather" if unit.primitive == "native" else "all_reduce"
        return [PlannedCall(node, op, layout.total_numel)]

    def _scatter_calls(self, unit: UnitState) -> list[PlannedCall]:
        layout, calls = unit.layout, []
        hierarchy = unit.config.hierarchy
        if layout.world_size > 1 and hierarchy is not None:  # inside each host, then across
            node, local = scatter_node(layout.name), len(hierarchy.intra_ranks)
            calls.append(scatter_call(node, layout.total_numel, hierarchy.native))
            calls.append(scatter_call(node, layout.total_numel // local, hierarchy.native))
        elif layout.world_size > 1:
            primitive = unit.scatter_primitive or unit.primitive
            op = {"native": "reduce_scatter", "all_to_all": "all_to_all"}.get(
                primitive, "all_reduce"
            )
            calls.append(PlannedCall(scatter_node(layout.name), op, layout.total_numel))
        if unit.replicas > 1:
            calls.append(PlannedCall(replicate_node(layout.name), "all_reduce", layout.shard_numel))
        return calls

    def _backward_order(self) -> list[UnitState]:
        """Units with a gradient, in the plan's backward order."""
        plan = self.plan
        assert plan is not None
        units = self._engine_units
        return [units[n.unit] for n in plan.nodes if n.id == scatter_node(n.unit)]

    def _planned_calls(self) -> list[PlannedCall]:
        calls = [c for unit in self._order for c in self._gather_calls(unit)]
        calls += [c for composed in self.inside for c in composed.planned_calls()]
        calls += [  # whole parameters' gradients summed over a split's group
            PlannedCall(node, "all_reduce", None)
            for composed in self.inside
            for node, _ in composed.summed_gradients()
        ]
        calls += [c for unit in self._backward_order() for c in self._scatter_calls(unit)]
        if self._clips_over_ranks():
            calls.append(PlannedCall(NORM_NODE, "all_reduce", 1 + len(self.inside)))
        if self.options.max_norm is not None:
            calls += [PlannedCall(split_norm_node(c.name), "all_reduce", 1) for c in self.inside]
        return calls

    def _issued(self) -> list[str]:
        own = [c for unit in self._order for c in self._gather_calls(unit)]
        own += [c for unit in self._backward_order() for c in self._scatter_calls(unit)]
        nodes = [c.node for c in own]
        if self._clips_over_ranks():
            nodes.append(NORM_NODE)
        if self.options.max_norm is not None:
            nodes += [split_norm_node(c.name) for c in self.inside]
        return list(dict.fromkeys(nodes))

    # -- the graph ---------------------------------------------------------------------------
    @contextmanager
    def _replaying(self) -> Iterator[None]:
        """The model's own forward, its units' hooks inert (they see whole parameters)."""
        engine = self.sharding.engine
        assert engine is not None
        engine.summoned = True
        try:
            with seen_as(self.model, self.model_class):
                yield
        finally:
            engine.summoned = False

    def _arguments(self) -> tuple[Any, ...]:
        """The shard buffers in forward order, the buffers, each group's parameter names
        and the optimizer's state tensors (local shards)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        grouped = [[names[id(p)] for p in trained(g)] for g in self.optimizer.param_groups]
        shards = [unit.shard for unit in self._order]
        buffers = dict(self.model.named_buffers())
        return shards, buffers, grouped, self._functional.tensors(_local).states

    def _graph(
        self, arguments: tuple[Any, ...], lrs: list[torch.Tensor], inputs: list[Any], target: Any
    ) -> torch.Tensor:
        shards, buffers, grouped, states = arguments
        model, loss_fn = self.model, self.loss_fn
        whole: dict[str, torch.Tensor] = {}
        for unit, shard in zip(self._order, shards, strict=True):
            whole.update(_unsharded(unit.layout, _gathered(unit, shard)))
        frozen = {n: t for n, t in whole.items() if not self._requires_grad(n)}
        params = {n: t for n, t in whole.items() if n not in frozen}

        def loss_of(trainable: dict[str, torch.Tensor]) -> torch.Tensor:
            out = functional_call(model, {**trainable, **frozen, **buffers}, tuple(inputs))
            loss: torch.Tensor = loss_fn(out, target)
            return loss

        grads, loss = grad_and_value(loss_of)(params)
        for composed in self.inside:
            grads = _summed_over_split(grads, composed)
        local_grads: dict[str, torch.Tensor] = {}
        local_params: dict[str, torch.Tensor] = {}
        by_unit = dict(zip((u.layout.name for u in self._order), shards, strict=True))
        for unit in self._backward_order():
            layout, rank = unit.layout, unit.rank
            mean = _reduced(unit, _scatter_input(layout, grads))
            shard = by_unit[layout.name]
            for p in layout.params:
                local_grads[p.name] = _local_slice(mean, p, rank)
                local_params[p.name] = _local_slice(shard, p, rank)
        norm = None
        if self.options.max_norm is not None:
            local_grads, norm = self._clipped(local_grads)
        updated = UpdatedTensors([[local_params[n] for n in names] for names in grouped], states)
        self._functional.update(updated, [[local_grads[n] for n in g] for g in grouped], lrs)
        detached: torch.Tensor = loss.detach()
        if norm is not None:
            return torch.stack([detached, norm.to(detached.dtype)])
        return detached

    def _clipped(
        self, local_grads: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The shards' gradients scaled as ``torch.nn.utils.clip_grad_norm_`` scales the
        whole model's, and the total norm. Each rank's part of the norm is summed (or the
        largest taken) over the shard group, where every element lies on one rank;
        replicas (HSDP) hold the same shards. A composed split (tp) keeps its parameters'
        parts apart, summed again over its group (one slice per rank), where the whole
        parameters' are not (the same on each of its ranks)."""
        max_norm, norm_type = self.options.max_norm, self.options.norm_type
        assert max_norm is not None
        infinite = norm_type == float("inf")
        split = [c.split_parameters() for c in self.inside]
        groups: list[list[torch.Tensor]] = [[] for _ in range(len(split) + 1)]
        for name, grad in local_grads.items():
            if grad.numel():
                where = next((k + 1 for k, names in enumerate(split) if name in names), 0)
                groups[where].append(grad.detach())
        device = next((g.device for g in local_grads.values()), None)
        parts = torch.stack([_norm_part(values, norm_type, device) for values in groups])
        op = "max" if infinite else "sum"
        if self._clips_over_ranks():
            parts = funcol.all_reduce(parts, op, _group(self._order[0]))
        pieces = [parts[0]]
        for k, composed in enumerate(self.inside):
            pieces.append(funcol.all_reduce(parts[k + 1 : k + 2], op, composed.group()[0])[0])
        combined = torch.stack(pieces)
        total = combined.max() if infinite else combined.sum() ** (1.0 / norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return {n: g * scale for n, g in local_grads.items()}, total

    def _requires_grad(self, name: str) -> bool:
        return bool(self._param(name).requires_grad)

    def _param(self, name: str) -> nn.Parameter:
        for unit in self._order:
            if name in unit.params:
                return unit.params[name]
        raise KeyError(name)


def _summed_over_split(
    grads: dict[str, torch.Tensor], composed: InGraphCollectives
) -> dict[str, torch.Tensor]:
    """``grads`` with the whole parameters' gradients ``composed`` sums over its group
    summed, one all-reduce of their concatenation per plan node."""
    pg = composed.group()[0]
    out = dict(grads)
    for _, names in composed.summed_gradients():
        held = [n for n in names if n in out]
        if not held:
            continue
        flat = torch.cat([out[n].reshape(-1) for n in held])
        summed = funcol.all_reduce(flat, "sum", pg)
        pieces = torch.split(summed, [out[n].numel() for n in held])
        out.update({n: piece.view_as(out[n]) for n, piece in zip(held, pieces, strict=True)})
    return out


def split_norm_node(strategy: str) -> str:
    """Plan node of the gradient norm's all-reduce over a composed split's group."""
    return f"grad_norm.{strategy}"


def _norm_part(
    values: list[torch.Tensor], norm_type: float, device: torch.device | None
) -> torch.Tensor:
    """This rank's part of the norm of ``values``: the sum of their elements' powers
    (the largest magnitude for the infinity norm), 0 for none."""
    zero = torch.zeros((), device=device)
    if norm_type == float("inf"):
        return torch.stack([zero, *(g.abs().max() for g in values)]).max()
    return torch.stack(
        [zero, *(torch.linalg.vector_norm(g, norm_type) ** norm_type for g in values)]
    ).sum()


def _with_split_norm_node(plan: ExecutionPlan, composed: InGraphCollectives) -> ExecutionPlan:
    """``plan`` with the all-reduce of the split parameters' norm part over ``composed``'s
    group (one float32)."""
    _, ranks, axis = composed.group()
    node = PlanNode(
        split_norm_node(composed.name),
        "collective",
        "backward",
        f"gradient norm: the {composed.name}-split parameters' part summed over its group",
        Collective("gradient", layer="gradient norm"),
        CollectiveSpec("all_reduce", "float32", 1, 4, ranks, axis=axis),
    )
    return plan.with_nodes((*plan.nodes, node))


def _with_norm_node(plan: ExecutionPlan, unit: UnitState, parts: int) -> ExecutionPlan:
    """``plan`` with the gradient norm's all-reduce over ``unit``'s shard group (``parts``
    float32: one per composed split, and the rest), on the group and axis of the unit's
    reduce-scatter."""
    scatter = plan.node(scatter_node(unit.layout.name)).collective
    assert scatter is not None
    norm = PlanNode(
        NORM_NODE,
        "collective",
        "backward",
        "gradient norm: each shard's part summed over the shard group (clipping)",
        Collective("gradient", layer="gradient norm"),
        CollectiveSpec("all_reduce", "float32", parts, 4, scatter.group, axis=scatter.axis),
    )
    return plan.with_nodes((*plan.nodes, norm))


def _group(unit: UnitState) -> dist.ProcessGroup:
    group = unit.config.group
    world = dist.group.WORLD
    assert world is not None
    return group if group is not None else world


def _gathered(unit: UnitState, shard: torch.Tensor) -> torch.Tensor:
    """Every rank's shard buffer, rank-major (``total_numel``), by the unit's primitive."""
    layout = unit.layout
    w, n, rank = layout.world_size, layout.shard_numel, unit.rank
    if w == 1:
        return shard
    if unit.config.hierarchy is not None:
        return _hierarchical_gather(unit.config.hierarchy, shard)
    group = _group(unit)
    if unit.primitive in ("native", "broadcast"):
        return gather_over(shard, group, native=unit.primitive == "native")
    placed = torch.cat([shard.new_zeros(rank * n), shard, shard.new_zeros((w - rank - 1) * n)])
    summed: torch.Tensor = funcol.all_reduce(placed, "sum", group)
    return summed


def _unsharded(layout: UnitLayout, gathered: torch.Tensor) -> dict[str, torch.Tensor]:
    """The unit's parameters, whole, from the rank-major gathered buffer."""
    slots = gathered.view(layout.world_size, layout.shard_numel)
    out = {}
    for p in layout.params:
        rows = slots[:, p.offset : p.offset + p.chunk]
        if p.replicated:
            out[p.name] = rows[0, 0]
        else:
            out[p.name] = rows.reshape(-1)[: p.numel].view(p.shape)
    return out


def _scatter_input(layout: UnitLayout, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reduce-scatter input of the unit's gradients (rank-major), as the eager step
    lays it out: each rank's row chunk of every gradient (zeros for a frozen parameter),
    one used-flag per parameter (1 for every trained one: the first step checked that
    some rank reaches each), zeros to the end of the slot."""
    w = layout.world_size
    like = next(g for p in layout.params if (g := grads.get(p.name)) is not None)
    pieces = []
    for p in layout.params:
        g = grads.get(p.name)
        if g is None:  # frozen: no gradient, flag 0
            pieces.append(like.new_zeros(w, p.chunk))
        elif p.replicated:
            pieces.append(g.reshape(1, 1).expand(w, 1))
        else:
            flat = g.reshape(-1)
            pieces.append(F.pad(flat, (0, w * p.chunk - p.numel)).view(w, p.chunk))
    flags = [1.0 if p.name in grads else 0.0 for p in layout.params]
    pieces.append(torch.tensor(flags, dtype=like.dtype, device=like.device).expand(w, -1))
    tail = layout.shard_numel - layout.flag_offset - len(layout.params)
    pieces.append(like.new_zeros(w, tail))
    return torch.cat(pieces, dim=1).view(-1)


def _reduced(unit: UnitState, scatter_in: torch.Tensor) -> torch.Tensor:
    """This rank's slot of the mean over the shard group (then over the replicas)."""
    layout = unit.layout
    w, n, rank = layout.world_size, layout.shard_numel, unit.rank
    primitive = unit.scatter_primitive or unit.primitive
    if w == 1:
        mean = scatter_in
    elif unit.config.hierarchy is not None:
        mean = _hierarchical_scatter(unit.config.hierarchy, scatter_in) / w
    elif primitive in ("native", "all_to_all"):
        mean = scatter_over(scatter_in, _group(unit), native=primitive == "native") / w
    else:
        summed = funcol.all_reduce(scatter_in, "sum", _group(unit))
        mean = summed.view(w, n)[rank] / w
    if unit.replicas > 1:
        group = unit.config.replicate_group
        assert group is not None
        mean = funcol.all_reduce(mean / unit.replicas, "sum", group)
    return mean


def _local_slice(flat: torch.Tensor, p: ParamShard, rank: int) -> torch.Tensor:
    """``p``'s local shard as a view of a shard-sized buffer."""
    piece: torch.Tensor = flat[p.offset : p.offset + p.local_numel(rank)]
    return piece.view(p.local_shape(rank))


def _inverse(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where each slot of rank order sits in ``order``."""
    inverse = [0] * len(order)
    for position, slot in enumerate(order):
        inverse[slot] = position
    return torch.tensor(inverse, dtype=torch.long, device=device)


def _hierarchical_gather(hierarchy: HostHierarchy, shard: torch.Tensor) -> torch.Tensor:
    """The two-phase gather: across the hosts, then inside this one; the slots put back
    in rank order."""
    mine = gather_over(shard, hierarchy.inter, hierarchy.native)
    staged = gather_over(mine, hierarchy.intra, hierarchy.native)
    if hierarchy.identity:
        return staged
    slots = staged.view(hierarchy.world_size, -1)
    return slots.index_select(0, _inverse(hierarchy.order, shard.device)).view(-1)


def _hierarchical_scatter(hierarchy: HostHierarchy, scatter_in: torch.Tensor) -> torch.Tensor:
    """The two-phase reduce-scatter (a sum): inside this host, then across the hosts, on
    the slots in the phases' order."""
    ordered = scatter_in
    if not hierarchy.identity:
        index = torch.tensor(hierarchy.order, dtype=torch.long, device=scatter_in.device)
        ordered = scatter_in.view(hierarchy.world_size, -1).index_select(0, index).view(-1)
    chunk = scatter_over(ordered, hierarchy.intra, hierarchy.native)
    return scatter_over(chunk, hierarchy.inter, hierarchy.native)
