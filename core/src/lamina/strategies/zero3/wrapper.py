"""ZeRO-3 data parallelism (``lamina.distribute(model, "zero3")``).

Parameters, gradients and optimizer state are sharded across the data-parallel group:
the wrapper's ``parameters()`` are this rank's flat shards (one per unit), so a stock
``torch.optim`` optimizer keeps state for the shard only. See
:mod:`lamina.memory.engine` for how units are gathered and freed. The layout and unit
order become an :class:`~lamina.runtime.ExecutionPlan` (gathers, reduce-scatters and
their primitives, frees, the optimizer step) that every rank verifies against the
others before the first collective; the engine takes its primitives from the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.memory import ShardLayout, build_layout, group_units
from lamina.memory.engine import UnitState, Zero3Engine
from lamina.memory.gather import Primitive
from lamina.memory.units import ROOT_UNIT
from lamina.runtime import ExecutionPlan, RunLog
from lamina.runtime.primitives import PrimitiveChoice, choose_primitive, disabled_from_env
from lamina.strategies.coalesced import dtype_totals, run_broadcast_nodes
from lamina.strategies.contract import Placement, PlannedStep
from lamina.strategies.preflight import before_first_collective
from lamina.strategies.zero3 import plan as plan_z3
from lamina.strategies.zero3 import state as shard_state
from lamina.strategies.zero3.accounting import MemoryAccount, memory_accounting
from lamina.strategies.zero3.options import Zero3Options
from lamina.verify import PreflightReport

if TYPE_CHECKING:
    from lamina.session import Runtime


class ShardedDataParallel(nn.Module):
    """Wraps ``module`` so that every rank of a shard group holds 1/N of its parameters.

    The shard group is the one ``placement`` shards over on ``runtime.mesh`` (every axis
    by default: the whole job, ZeRO-3); the axes it replicates over (HSDP's ``inter``)
    hold copies of the shards, and each shard gradient is all-reduced across them after
    its reduce-scatter. A unit named after one submodule is gathered around that
    submodule's forward and freed after it; the root unit and merged units are gathered
    for the whole forward. Every unit is gathered again in backward when needed. The
    options are :class:`~lamina.strategies.zero3.options.Zero3Options`.
    """

    def __init__(
        self,
        module: nn.Module,
        runtime: Runtime,
        placement: Placement | None = None,
        options: Zero3Options | None = None,
        *,
        strategy: str = "zero3",
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ConfigError("ZeRO-3 needs torch.distributed; call lamina.init() first")
        options = options or Zero3Options()
        placement = placement or Placement(shard=runtime.mesh.axis_names)
        if not placement.shard:
            raise ConfigError(
                f"strategy {strategy!r} shards over no mesh axis (placement "
                f"{placement.describe()}); name at least one axis in shard=, or use 'dp'"
            )
        mesh = runtime.mesh
        self.runtime = runtime
        self.placement = placement
        self.group, shard_ranks = mesh.group_over(placement.shard)
        self.replicate_group: dist.ProcessGroup | None = None
        replicas: tuple[int, ...] = ()
        if placement.replicate:
            self.replicate_group, replicas = mesh.group_over(placement.replicate)
        world = len(shard_ranks)
        rank = shard_ranks.index(dist.get_rank())
        self.layout: ShardLayout = build_layout(
            module,
            world,
            alignment_bytes=options.alignment_bytes,
            units=group_units(module, min_unit_numel=options.min_unit_numel),
        )
        groups = plan_z3.PlanGroups(
            shard=shard_ranks,
            shard_axis=mesh.axes_label(placement.shard),
            replicate=replicas,
            replicate_axis=mesh.axes_label(placement.replicate) if replicas else "",
            everyone=tuple(range(runtime.world_size)),
            everyone_axis=mesh.axes_label(mesh.axis_names),
        )
        self.execution_plan: ExecutionPlan = _build_plan(
            module, self.layout, runtime, self.group, groups, options, strategy
        )
        shard_lines = plan_z3.shard_lines(self.layout)
        planned = PlannedStep(self.execution_plan, (("shards", shard_lines),))
        self.preflight: PreflightReport | None = before_first_collective(
            runtime, planned, module, verify=options.verify
        )
        self.run_log = RunLog(self.execution_plan)
        initial = [*module.parameters(), *module.buffers()]
        run_broadcast_nodes(self.run_log, "setup", initial, 0, None)
        places = _places(module)
        gather_op = _gather_primitive(self.execution_plan)
        scatter_op = _scatter_primitive(self.execution_plan)
        units = []
        for unit in self.layout.units:
            named = {p.name: _param(module, p.name) for p in unit.params}
            with torch.no_grad():
                full = unit.flatten({n: t.detach() for n, t in named.items()})
                shard = nn.Parameter(unit.shard_of(full, rank).clone())
            units.append(
                UnitState(
                    unit,
                    shard,
                    {n: places[n] for n in named},
                    rank,
                    gather_op,
                    self.group,
                    compute_dtype=options.param_dtype,
                    scatter_primitive=scatter_op,
                    nodes={
                        "fwd": plan_z3.gather_node(unit.name, "fwd"),
                        "bwd": plan_z3.gather_node(unit.name, "bwd"),
                        "scatter": plan_z3.scatter_node(unit.name),
                        "replicate": plan_z3.replicate_node(unit.name),
                    },
                    observer=self.run_log,
                    replicate_group=self.replicate_group,
                    replicas=len(replicas),
                )
            )
        self.param_dtype = options.param_dtype
        for state in units:
            for module_places in state.places.values():
                for owner, attr in module_places:
                    if attr in owner._parameters:
                        del owner._parameters[attr]
        self.module = module
        self.shards = nn.ParameterList([u.shard for u in units])
        self.engine = Zero3Engine(units, module, options.reshard_after_forward)
        self.engine.observer = self.run_log
        #: Units gathered for the whole forward: the root unit, and merged units that do
        #: not correspond to one submodule.
        self._whole_forward: list[UnitState] = []
        for state in units:
            submodule = _submodule(module, state.layout.name)
            if submodule is None:
                self._whole_forward.append(state)
            else:
                self._hook_unit(submodule, state)
        for state in units:
            self.engine.leave_unit(state)  # module attributes hold no full parameters

    def _hook_unit(self, submodule: nn.Module, state: UnitState) -> None:
        engine = self.engine
        submodule.register_forward_pre_hook(lambda _m, _a: engine.enter_unit(state))
        submodule.register_forward_hook(lambda _m, _a, _o: engine.leave_unit(state))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the root unit for the whole forward; block units gather around themselves."""
        if self.training and torch.is_grad_enabled():
            self.run_log.begin_step()
        self.engine.drop_stale_prefetches()
        if self.param_dtype is not None:  # mixed precision: floating inputs in param dtype
            args, kwargs = _cast_floats((args, kwargs), self.param_dtype)
        with self.engine.saved_views_as_tokens(), self.run_log.compute("forward"):
            for state in self._whole_forward:
                self.engine.enter_unit(state)
            try:
                out = self.module(*args, **kwargs)
            finally:
                for state in self._whole_forward:
                    self.engine.leave_unit(state)
        self.engine.finish_forward()
        return out

    def step_summary(self) -> str:
        """One line: collectives of the last step and every fallback taken."""
        return self.run_log.summary()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient shards so that the global gradient norm is at most ``max_norm``.

        The norm is over the whole model (squared shard norms summed across ranks), as
        ``torch.nn.utils.clip_grad_norm_`` would compute it on the unsharded model.
        """
        grads = [p.grad for p in self.shards if p.grad is not None]
        device = self.shards[0].device if len(self.shards) else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            squares += grad.detach().float().pow(2).sum()
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(squares, group=self.group)
        total = squares.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale.to(grad.dtype))
        return total

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds for parameter shards, gradient shards and optimizer state."""
        params = sum(p.numel() * p.element_size() for p in self.shards)
        grads = sum(
            p.grad.numel() * p.grad.element_size() for p in self.shards if p.grad is not None
        )
        state = 0
        if optimizer is not None:
            for per_param in optimizer.state.values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        state += value.numel() * value.element_size()
        return {"parameters": params, "gradients": grads, "optimizer_state": state}

    def memory_accounting(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryAccount:
        """This rank's model-state bytes against the ZeRO-3 formula (see ``.table()``)."""
        return memory_accounting(self, optimizer)

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded state dict on the CPU (collective); see :mod:`lamina.memory.state`."""
        return shard_state.full_state_dict(self, rank0_only=rank0_only)

    def load_full_state_dict(self, full: Mapping[str, torch.Tensor]) -> None:
        """Take this rank's slice of a full state dict."""
        shard_state.load_full_state_dict(self, full)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards as DTensors plus the layout, for ``torch.distributed.checkpoint``."""
        return shard_state.sharded_state_dict(self)

    def load_sharded_state_dict(self, sharded: Mapping[str, Any]) -> None:
        """Copy a sharded state dict (after ``dcp.load``) back into the shards."""
        shard_state.load_sharded_state_dict(self, sharded)


def _build_plan(
    module: nn.Module,
    layout: ShardLayout,
    runtime: Runtime,
    group: dist.ProcessGroup | None,
    groups: plan_z3.PlanGroups,
    options: Zero3Options,
    strategy: str,
) -> ExecutionPlan:
    pg_backend = str(dist.get_backend(group))
    unsupported = runtime.backend.unsupported_collectives
    disabled = {*options.disable_collectives, *disabled_from_env()}

    def choice(op: str) -> PrimitiveChoice:
        return choose_primitive(
            op, pg_backend, mode=options.collectives, disable=disabled, unsupported=unsupported
        )

    whole = frozenset(u.name for u in layout.units if _submodule(module, u.name) is None)
    order = [u.name for u in layout.units if u.name in whole]
    order += [u.name for u in layout.units if u.name not in whole]
    param_dtype = options.param_dtype
    return plan_z3.build_zero3_plan(
        plan_z3.Zero3PlanInputs(
            layout=layout,
            forward_order=order,
            whole_forward=whole,
            groups=groups,
            backend=runtime.backend.name,
            pg_backend=pg_backend,
            gather=choice("all_gather"),
            scatter=choice("reduce_scatter"),
            setup_state=dtype_totals([*module.parameters(), *module.buffers()]),
            compute_dtype=dtype_name(param_dtype) if param_dtype else None,
            reshard_after_forward=options.reshard_after_forward,
            strategy=strategy,
        )
    )


def _gather_primitive(plan: ExecutionPlan) -> Primitive:
    """The primitive the plan's first gather node uses (all gathers share it)."""
    gathers = [n for n in plan.nodes if n.kind == "gather"]
    op = gathers[0].attr("primitive") if gathers else "all_gather"
    return "native" if op == "all_gather" else "all_reduce"


def _scatter_primitive(plan: ExecutionPlan) -> Primitive:
    scatters = [n for n in plan.nodes if n.id.endswith(".reduce_scatter")]
    op = scatters[0].attr("primitive") if scatters else "reduce_scatter"
    return "native" if op == "reduce_scatter" else "all_reduce"


def _places(module: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Canonical parameter name -> every (module, attribute) that holds that parameter."""
    canonical = {id(p): name for name, p in module.named_parameters()}
    places: dict[str, list[tuple[nn.Module, str]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        places.setdefault(canonical[id(param)], []).append((owner, attr))
    return places


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    """The submodule a unit is named after, or None (the root unit, a merged unit)."""
    if name == ROOT_UNIT:
        return None
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _param(module: nn.Module, name: str) -> torch.Tensor:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    tensor: torch.Tensor = getattr(owner, attr)
    return tensor
