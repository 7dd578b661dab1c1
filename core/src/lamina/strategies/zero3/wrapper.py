"""ZeRO-3 data parallelism (``lamina.distribute(model, "zero3")``) and, placed on two mesh
axes, HSDP.

The model keeps its parameters: :func:`shard_module` turns every trainable parameter
into a ``DTensor`` sharded on dim 0 over the shard group (replicated over the replica
group for HSDP) under its own name and shape, and returns the same module, its class
extended by :class:`ShardedModule`. So ``named_parameters()``, optimizer groups built by
name or shape, ``state_dict()`` and ``torch.distributed.checkpoint.state_dict`` work as
with FSDP2. The local shards are views of each unit's flat shard buffer, which the
engine all-gathers and reduce-scatters (:mod:`lamina.memory.engine`). The layout and
unit order become an :class:`~lamina.runtime.ExecutionPlan` that every rank verifies
against the others before the first collective; the engine takes its primitives from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.codecs import Fp8Codec
from lamina.comm.cost import AlgorithmChoice
from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.memory import ShardLayout, build_layout, group_units
from lamina.memory.engine import UnitState, Zero3Engine, comm_streams
from lamina.memory.gather import Primitive
from lamina.memory.hierarchy import HostHierarchy
from lamina.memory.units import ROOT_UNIT
from lamina.runtime import ExecutionPlan, RunLog
from lamina.runtime.nodes import Collective, Gather
from lamina.runtime.primitives import PrimitiveChoice, choose_primitive, disabled_from_env
from lamina.strategies.algorithm_choice import choose_algorithms, group_cost_model
from lamina.strategies.coalesced import dtype_totals, run_broadcast_nodes
from lamina.strategies.contract import Placement as MeshPlacement
from lamina.strategies.contract import PlannedStep
from lamina.strategies.preflight import before_first_collective
from lamina.strategies.zero3 import plan as plan_z3
from lamina.strategies.zero3.accounting import MemoryAccount, memory_accounting
from lamina.strategies.zero3.fp8_units import Fp8UnitCodec, sharded_codec
from lamina.strategies.zero3.full_params import (
    full_parameters_forward,
    save_pretrained_method,
    summon_full_parameters,
)
from lamina.strategies.zero3.init_rng import register_shards
from lamina.strategies.zero3.load_full import sharded_state
from lamina.strategies.zero3.materialize import move_shards, on_meta
from lamina.strategies.zero3.options import Zero3Options
from lamina.verify import PreflightReport

if TYPE_CHECKING:
    from lamina.session import Runtime


class Sharding:
    """What a sharded model carries besides its parameters (``model.lamina_sharding``)."""

    def __init__(
        self,
        runtime: Runtime,
        placement: MeshPlacement,
        layout: ShardLayout,
        execution_plan: ExecutionPlan,
        run_log: RunLog,
        preflight: PreflightReport | None,
        group: dist.ProcessGroup | None,
        param_dtype: torch.dtype | None,
    ) -> None:
        self.runtime = runtime
        self.placement = placement
        self.layout = layout
        self.execution_plan = execution_plan
        self.run_log = run_log
        self.preflight = preflight
        #: This rank's shard group (None: the whole job).
        self.group = group
        self.param_dtype = param_dtype
        self.engine: Zero3Engine | None = None
        #: The process groups of the hierarchical gathers and reduce-scatters (None:
        #: every unit is flat).
        self.algorithm_groups: AlgorithmGroups | None = None
        #: Units gathered for the whole forward: the root unit, and merged units that do
        #: not correspond to one submodule.
        self.whole_forward: list[UnitState] = []
        #: Whether parameters or buffers are still on the meta device (``to_empty`` first).
        self.on_meta = False


class ShardedModule(nn.Module):
    """The methods a model sharded by ``zero3`` / ``hsdp`` gains (its class is extended,
    not wrapped, so ``isinstance`` and every attribute of the model still hold)."""

    lamina_sharding: Sharding

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the root unit for the whole forward; block units gather around themselves."""
        sharding = self.lamina_sharding
        engine = sharding.engine
        assert engine is not None
        if sharding.on_meta:
            raise ConfigError(
                f"this {type(self).__name__} is on the meta device; call "
                "model.to_empty(device=...) and initialize or load it before the forward"
            )
        if engine.summoned:
            return full_parameters_forward(self, super().forward, args, kwargs)
        if self.training and torch.is_grad_enabled():
            sharding.run_log.begin_step()
        engine.drop_stale_prefetches()
        if sharding.param_dtype is not None:  # mixed precision: floating inputs in its dtype
            args, kwargs = _cast_floats((args, kwargs), sharding.param_dtype)
        with engine.saved_views_as_tokens(), sharding.run_log.compute("forward"):
            for state in sharding.whole_forward:
                engine.enter_unit(state)
            try:
                out = super().forward(*args, **kwargs)
            finally:
                for state in sharding.whole_forward:
                    engine.leave_unit(state)
        if torch.is_grad_enabled():  # backward may recompute a forward that reads them
            engine.enter_on_backward(out, tuple(sharding.whole_forward))
        engine.finish_forward()
        return out

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to()``, ``to_empty()``, ``cuda()`` and the like: the shard buffers are
        converted (``to_empty`` materializes only this rank's shards) and the parameters
        become views of the new buffers, the same parameter objects; buffers and
        anything else convert as torch converts them."""
        move_shards(self, fn, lambda: super(ShardedModule, self)._apply(fn, recurse))  # type: ignore[no-untyped-call]
        return self

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """torch's ``load_state_dict``, also from a full (unsharded) state dict held by
        every rank: each rank loads its rows of each parameter (no collective)."""
        strategy = self.execution_plan.strategy
        state = sharded_state(self, state_dict, assign, strategy)
        return super().load_state_dict(state, strict=strict, assign=assign)

    @contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Every parameter whole, as a plain tensor, on every rank for the block (like
        FSDP's ``summon_full_params``): for ``save_pretrained``, ``state_dict()`` of the
        whole model, or a fast ``generate``. Collective: every rank enters it. Holds the
        whole model on each rank. ``writeback=True`` copies the whole parameters back
        into the shards on exit (changes made inside then persist); otherwise they are
        dropped. Forwards inside run on the whole parameters, without autograd."""
        with summon_full_parameters(self, writeback):
            yield

    @property
    def execution_plan(self) -> ExecutionPlan:
        """The plan of one step (gathers, reduce-scatters, frees, the optimizer)."""
        return self.lamina_sharding.execution_plan

    @property
    def run_log(self) -> RunLog:
        """What each step issued and which run-time fallbacks it took."""
        return self.lamina_sharding.run_log

    @property
    def preflight(self) -> PreflightReport | None:
        """The pre-flight verification report (None when it was turned off)."""
        return self.lamina_sharding.preflight

    @property
    def lamina_engine(self) -> Zero3Engine:
        """The units and their gathers (for tests and inspection)."""
        engine = self.lamina_sharding.engine
        assert engine is not None
        return engine

    @property
    def lamina_layout(self) -> ShardLayout:
        """The shard layout (units, row splits, buffer sizes)."""
        return self.lamina_sharding.layout

    def step_summary(self) -> str:
        """One line: collectives of the last step and every fallback taken."""
        return self.lamina_sharding.run_log.summary()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that the global gradient norm is at most ``max_norm``;
        the norm is the unsharded model's, as ``torch.nn.utils.clip_grad_norm_`` computes
        it: sharded gradients summed over the shard group, replicated ones once."""
        sharded: list[torch.Tensor] = []
        plain: list[torch.Tensor] = []
        for p in self.parameters():
            if p.grad is not None:
                (sharded if isinstance(p.grad, DTensor) else plain).append(p.grad)
        device = next(self.parameters()).device
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in sharded:
            if isinstance(grad, DTensor) and _is_sharded(grad):
                squares += grad.to_local().detach().float().pow(2).sum()
        group = self.lamina_sharding.group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
        replicated = [g for g in sharded if isinstance(g, DTensor) and not _is_sharded(g)]
        for grad in [*plain, *replicated]:
            squares += _local(grad).detach().float().pow(2).sum()
        total = squares.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in [*sharded, *plain]:
            _local(grad).mul_(scale.to(grad.dtype))
        return total

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds for parameter shards, gradient shards and optimizer state."""
        account = memory_accounting(self, optimizer)
        return {
            "parameters": account.parameter_bytes,
            "gradients": account.gradient_bytes,
            "optimizer_state": account.optimizer_bytes,
        }

    def memory_accounting(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryAccount:
        """This rank's model-state bytes against the ZeRO-3 formula (see ``.table()``)."""
        return memory_accounting(self, optimizer)


def shard_module(
    module: nn.Module,
    runtime: Runtime,
    placement: MeshPlacement | None = None,
    options: Zero3Options | None = None,
    *,
    strategy: str = "zero3",
) -> ShardedModule:
    """Shard ``module`` in place (see the module docstring) and return it."""
    if not dist.is_initialized():
        raise ConfigError("ZeRO-3 needs torch.distributed; call lamina.init() first")
    if isinstance(module, ShardedModule):
        raise ConfigError(
            f"this {type(module).__name__} is already sharded; distribute the model once"
        )
    if hasattr(type(module), "execution_plan") and hasattr(type(module), "step_summary"):
        raise ConfigError(
            f"this {type(module).__name__} is already distributed (it has an "
            "execution_plan); distribute the model once, with one strategy"
        )
    options = options or Zero3Options()
    placement = placement or MeshPlacement(shard=runtime.mesh.axis_names)
    if not placement.shard:
        raise ConfigError(
            f"strategy {strategy!r} shards over no mesh axis (placement "
            f"{placement.describe()}); name at least one axis in shard=, or use 'dp'"
        )
    mesh = runtime.mesh
    group, shard_ranks = mesh.group_over(placement.shard)
    replicate_group: dist.ProcessGroup | None = None
    replicas: tuple[int, ...] = ()
    if placement.replicate:
        replicate_group, replicas = mesh.group_over(placement.replicate)
    world = len(shard_ranks)
    rank = shard_ranks.index(dist.get_rank())
    layout = build_layout(
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
    codec = sharded_codec(options.codec, runtime.kernels)
    cost_model = group_cost_model(runtime.topology, shard_ranks)
    choices = choose_algorithms(
        cost_model,
        {unit.name: unit.total_numel * unit.element_size for unit in layout.units},
        options.algorithm,
        pg_backend=str(dist.get_backend(group)),
        # the hierarchical forms need the shard group to be the whole job in rank order
        # (slot r is rank r's shard)
        whole_job=shard_ranks == tuple(range(dist.get_world_size())),
        sharded=True,
    )
    if codec is not None and not replicas:
        choices = {}  # ZeRO-3's fp8 reduce-scatter runs over the flat shard group
    described = cost_model.describe() if cost_model is not None and choices else ""
    plan = _build_plan(
        module, layout, runtime, group, groups, options, strategy, choices, described, codec
    )
    codec_role = plan_z3.codec_role_of(plan)
    planned = PlannedStep(plan, (("shards", plan_z3.shard_lines(layout)),))
    preflight = before_first_collective(runtime, planned, module, verify=options.verify)
    run_log = RunLog(plan)
    run_broadcast_nodes(run_log, "setup", _materialized(module), 0, None)
    sharding = Sharding(
        runtime, placement, layout, plan, run_log, preflight, group, options.param_dtype
    )
    dtensor_mesh, placements = _dtensor_mesh(runtime, placement)
    places = _places(module)
    hierarchical = _hierarchical_units(plan)
    if hierarchical and cost_model is not None:  # after pre-flight: every rank agrees
        sharding.algorithm_groups = AlgorithmGroups(
            cost_model.layout,
            dist.get_rank(),
            flat=group,
            pg_backend=str(dist.get_backend(group)),
            needed=("hierarchical",),
        )
    hierarchy = _host_hierarchy(sharding.algorithm_groups)
    gather_op = _gather_primitive(plan)
    scatter_op = _scatter_primitive(plan)

    def make_grad(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor) and local.dtype == param.dtype:
            # the parameter's own spec (mesh, placements, global shape and stride,
            # dtype), which _as_dtensor would rebuild, without DTensor.from_local's
            # autograd function: every parameter, every step (FSDP2 builds its sharded
            # gradients so too)
            return DTensor(local, param._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        return _as_dtensor(local, param, dtensor_mesh, placements)

    planned_ids = {n.id for n in plan.nodes}
    units = []
    for unit in layout.units:
        full = {p.name: _param(module, p.name).detach() for p in unit.params}
        shard = unit.shard_of(full, rank)
        frozen = frozenset(p.name for p in unit.params if not _param(module, p.name).requires_grad)
        params = {
            name: nn.Parameter(
                _as_dtensor(local, full[name], dtensor_mesh, placements),
                requires_grad=name not in frozen,
            )
            for name, local in unit.local_views(shard, rank).items()
        }
        units.append(
            UnitState(
                unit,
                shard,
                params,
                {n: places[n] for n in params},
                rank,
                gather_op,
                group,
                make_grad,
                compute_dtype=options.param_dtype,
                scatter_primitive=scatter_op,
                nodes={
                    "fwd": plan_z3.gather_node(unit.name, "fwd"),
                    "bwd": plan_z3.gather_node(unit.name, "bwd"),
                    "scatter": plan_z3.scatter_node(unit.name),
                    "replicate": plan_z3.replicate_node(unit.name),
                },
                observer=run_log,
                replicate_group=replicate_group,
                replicas=max(1, len(replicas)),
                hierarchy=hierarchy if unit.name in hierarchical else None,
                codec=Fp8UnitCodec(codec) if codec is not None and codec_role else None,
                codec_role=codec_role or "scatter",
                keep_for_backward=options.reshard_after_forward
                and plan_z3.gather_node(unit.name, "bwd") not in planned_ids,
                frozen=frozen,
                planned_bwd_gather=plan_z3.gather_node(unit.name, "bwd") in planned_ids,
            )
        )
    device = next((u.shard.device for u in units), torch.device("cpu"))
    engine = Zero3Engine(
        units, module, options.reshard_after_forward, comm_streams(runtime.handle, device)
    )
    engine.observer = run_log
    sharding.engine = engine
    for state in units:
        submodule = _submodule(module, state.layout.name)
        if submodule is None:
            sharding.whole_forward.append(state)
        else:
            _hook_unit(engine, submodule, state)
        engine.leave_unit(state)  # the module holds the sharded parameters now
    cls = type(module)
    methods = save_pretrained_method(cls, strategy)
    # the model's own name (Hugging Face writes type(model).__name__ into a saved
    # config's "architectures"); its __module__ says where the extension comes from
    extended = type(cls.__name__, (ShardedModule, cls), methods)
    extended.__qualname__ = cls.__qualname__
    module.__class__ = extended
    assert isinstance(module, ShardedModule)
    module.__dict__["lamina_sharding"] = sharding  # plain state: not a submodule or buffer
    sharding.on_meta = on_meta(module)
    register_shards(engine.units)
    return module


def _hook_unit(engine: Zero3Engine, submodule: nn.Module, state: UnitState) -> None:
    submodule.register_forward_pre_hook(lambda _m, _a: engine.enter_unit(state))
    submodule.register_forward_hook(lambda _m, _a, out: engine.leave_unit(state, out))


def _materialized(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers not on the meta device (a model built on meta has
    nothing to broadcast: its values come from ``to_empty`` and an initializer or load)."""
    return [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]


def _dtensor_mesh(
    runtime: Runtime, placement: MeshPlacement
) -> tuple[TorchDeviceMesh, list[Placement]]:
    """The torch mesh and placements that describe the shards to DTensor: ``Shard(0)``
    over the shard axis, ``Replicate()`` over the replica axis (HSDP); a 1-D mesh over
    the whole job when the shards span every axis of a multi-axis mesh."""
    mesh = runtime.mesh
    if not placement.replicate:
        if len(mesh.axis_names) == 1:
            return mesh.torch_mesh, [Shard(0)]
        return init_device_mesh(runtime.backend.device_type, (runtime.world_size,)), [Shard(0)]
    if len(placement.shard) != 1 or len(placement.replicate) != 1:
        raise ConfigError(
            f"placement {placement.describe()}: sharded parameters need one shard axis and "
            "at most one replica axis; place the strategy on a 2-axis mesh"
        )
    return mesh.torch_mesh, [
        Shard(0) if axis in placement.shard else Replicate() for axis in mesh.axis_names
    ]


def _as_dtensor(
    local: torch.Tensor, like: torch.Tensor, mesh: TorchDeviceMesh, placements: list[Placement]
) -> DTensor:
    """``local`` as this rank's piece of a tensor shaped like ``like``: row-sharded, or
    replicated for a 0-dim one."""
    chosen = placements if like.dim() else [Replicate()] * len(placements)
    return DTensor.from_local(
        local, mesh, chosen, run_check=False, shape=like.shape, stride=like.stride()
    )


def _is_sharded(tensor: DTensor) -> bool:
    return any(isinstance(p, Shard) for p in tensor.placements)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local


def _hierarchical_units(plan: ExecutionPlan) -> frozenset[str]:
    """The units whose gathers and reduce-scatter the plan runs hierarchically."""
    return frozenset(
        n.unit
        for n in plan.nodes
        if (n.kind == "gather" or n.scatters_gradient)
        and n.algorithm is not None
        and n.algorithm.name == "hierarchical"
    )


def _host_hierarchy(groups: AlgorithmGroups | None) -> HostHierarchy | None:
    """The two-phase collectives over ``groups``' host and cross-host groups."""
    if groups is None:
        return None
    return HostHierarchy.for_rank(
        groups.layout.hosts,
        groups.rank,
        groups.intra,
        groups.inter,
        native=groups.pg_backend != "gloo",
        worker=groups.worker,
    )


def _build_plan(
    module: nn.Module,
    layout: ShardLayout,
    runtime: Runtime,
    group: dist.ProcessGroup | None,
    groups: plan_z3.PlanGroups,
    options: Zero3Options,
    strategy: str,
    algorithms: dict[str, AlgorithmChoice],
    cost_model: str,
    codec: Fp8Codec | None = None,
) -> ExecutionPlan:
    pg_backend = str(dist.get_backend(group))
    unsupported = runtime.backend.unsupported_collectives
    disabled = {*options.disable_collectives, *disabled_from_env()}

    def choice(op: str) -> PrimitiveChoice:
        return choose_primitive(
            op,
            pg_backend,
            mode=options.collectives,
            disable=disabled,
            unsupported=unsupported,
            group_size=len(groups.shard),
        )

    whole = frozenset(u.name for u in layout.units if _submodule(module, u.name) is None)
    order = [u.name for u in layout.units if u.name in whole]
    order += [u.name for u in layout.units if u.name not in whole]
    param_dtype = options.param_dtype
    # backward starts with the last unit, and needs the whole-forward ones until its end
    kept = whole | {order[-1]} if order and options.reshard_after_forward else frozenset()
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
            setup_state=dtype_totals(_materialized(module)),
            compute_dtype=dtype_name(param_dtype) if param_dtype else None,
            reshard_after_forward=options.reshard_after_forward,
            strategy=strategy,
            kept_for_backward=kept,
            algorithms=algorithms,
            cost_model=cost_model,
            codec=codec,
            frozen_units=_frozen_units(module, layout),
        )
    )


def _frozen_units(module: nn.Module, layout: ShardLayout) -> frozenset[str]:
    """The units none of whose parameters requires grad."""
    return frozenset(
        unit.name
        for unit in layout.units
        if not any(_param(module, p.name).requires_grad for p in unit.params)
    )


#: Plan op of a gather / reduce-scatter node -> the engine's primitive.
_PRIMITIVES: dict[str, Primitive] = {
    "all_gather": "native",
    "reduce_scatter": "native",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all",
}


def _gather_primitive(plan: ExecutionPlan) -> Primitive:
    """The primitive the plan's first gather node uses (all gathers share it)."""
    gathers = [g for n in plan.nodes if (g := n.facts(Gather)) is not None]
    return _PRIMITIVES[gathers[0].primitive if gathers else "all_gather"]


def _scatter_primitive(plan: ExecutionPlan) -> Primitive:
    """The primitive the plan's reduce-scatter nodes use."""
    scatters = [c for n in plan.nodes if n.scatters_gradient and (c := n.facts(Collective))]
    return _PRIMITIVES[scatters[0].primitive if scatters else "reduce_scatter"]


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
    """The submodule a unit is named after, or None (the root unit, a merged unit). The
    units of a block split by dtype (``"blocks.0[bfloat16]"``) are the block's too."""
    if name.endswith("]") and "[" in name:
        name = name[: name.rindex("[")]
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
