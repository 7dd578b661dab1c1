"""Building the ZeRO-3 engine over a module's shards, as the decoded plan says.

Each unit's shard becomes its flat shard buffer, and its parameters ``DTensor`` views of
that buffer (``Shard(0)`` over the shard group, replicated over the replicas for HSDP)
under their own names and shapes; the units' states run the plan's primitives,
algorithms and codec; block units gather around their submodule's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.codecs import TwoPhaseCodec
from lamina.comm.cost import CostModel
from lamina.errors import ConfigError
from lamina.memory import ShardLayout
from lamina.memory.engine import UnitState, Zero3Engine
from lamina.memory.hierarchy import HostHierarchy
from lamina.memory.streams import comm_streams
from lamina.memory.unit_config import UnitConfig
from lamina.runtime import RunLog
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import Placement as MeshPlacement
from lamina.strategies.zero3.engine_settings import EngineSettings
from lamina.strategies.zero3.groups import ShardGroups
from lamina.strategies.zero3.lookup import parameter, unit_submodule
from lamina.strategies.zero3.options import Zero3Options
from lamina.strategies.zero3.unit_codec import UnitCodec

#: The torch mesh and placements that describe the shards to DTensor.
DTensorMesh = tuple[TorchDeviceMesh, list[Placement]]


def dtensor_mesh(ctx: StrategyContext, placement: MeshPlacement) -> DTensorMesh:
    """The torch mesh and placements that describe the shards to DTensor: ``Shard(0)``
    over the shard axis, ``Replicate()`` over the replica axis (HSDP); a 1-D mesh over
    the whole job when the shards span every axis of a multi-axis mesh."""
    mesh = ctx.mesh
    placed = {*placement.shard, *placement.replicate}
    if placed != set(mesh.axis_names):  # composed: tp holds the other axes
        return _submesh_placements(mesh.torch_mesh, placement)
    if not placement.replicate:
        if len(mesh.axis_names) == 1:
            return mesh.torch_mesh, [Shard(0)]
        return init_device_mesh(ctx.backend.device_type, (ctx.world_size,)), [Shard(0)]
    if len(placement.shard) != 1 or len(placement.replicate) != 1:
        raise ConfigError(
            f"placement {placement.describe()}: sharded parameters need one shard axis and "
            "at most one replica axis; place the strategy on a 2-axis mesh"
        )
    return mesh.torch_mesh, [
        Shard(0) if axis in placement.shard else Replicate() for axis in mesh.axis_names
    ]


def _submesh_placements(root: TorchDeviceMesh, placement: MeshPlacement) -> DTensorMesh:
    """The mesh of the strategy's own axes when another strategy holds the rest: the
    shard axes flattened into one, the replica axis beside it."""
    names = root.mesh_dim_names or ()
    shard = tuple(a for a in names if a in placement.shard)
    sharded = root[shard] if len(shard) == 1 else root[shard]._flatten("+".join(shard))
    if not placement.replicate:
        return sharded, [Shard(0)]
    replicate = tuple(a for a in names if a in placement.replicate)
    if len(replicate) != 1 or len(shard) != 1:
        raise ConfigError(
            f"placement {placement.describe()}: a composed HSDP takes one shard axis and one "
            "replica axis; name one of each"
        )
    ordered = tuple(a for a in names if a in (*shard, *replicate))
    return root[ordered], [Shard(0) if a in shard else Replicate() for a in ordered]


def algorithm_groups(
    settings: EngineSettings, cost_model: CostModel | None, group: dist.ProcessGroup | None
) -> AlgorithmGroups | None:
    """The process groups of the plan's hierarchical units (None: every unit is flat).
    Collective (``new_group``): call it after pre-flight, when every rank agrees."""
    if not settings.hierarchical or cost_model is None:
        return None
    return AlgorithmGroups(
        cost_model.layout,
        dist.get_rank(),
        flat=group,
        pg_backend=str(dist.get_backend(group)),
        needed=("hierarchical",),
    )


def build_engine(
    module: nn.Module,
    ctx: StrategyContext,
    layout: ShardLayout,
    groups: ShardGroups,
    options: Zero3Options,
    *,
    settings: EngineSettings,
    codec: TwoPhaseCodec | None,
    mesh: DTensorMesh,
    hierarchical_groups: AlgorithmGroups | None,
    run_log: RunLog,
) -> Zero3Engine:
    """The engine over ``layout``'s units of ``module``, this rank's shard of each (the
    module does not hold the sharded parameters yet: see :func:`hook_units`)."""
    hierarchy = _host_hierarchy(hierarchical_groups)
    make_grad = _gradient_maker(mesh)
    places = _places(module)
    units = []
    for unit in layout.units:
        full = {p.name: parameter(module, p.name).detach() for p in unit.params}
        shard = unit.shard_of(full, groups.rank)
        frozen = frozenset(
            p.name for p in unit.params if not parameter(module, p.name).requires_grad
        )
        params = {
            name: nn.Parameter(
                _as_dtensor(local, full[name], mesh), requires_grad=name not in frozen
            )
            for name, local in unit.local_views(shard, groups.rank).items()
        }
        units.append(
            UnitState(
                UnitConfig(
                    unit,
                    shard,
                    params,
                    {n: places[n] for n in params},
                    groups.rank,
                    settings.gather,
                    groups.group,
                    make_grad,
                    compute_dtype=options.param_dtype,
                    scatter_primitive=settings.scatter,
                    nodes=settings.unit_nodes(unit.name),
                    observer=run_log,
                    replicate_group=groups.replicate_group,
                    replicas=max(1, len(groups.replicas)),
                    hierarchy=hierarchy if unit.name in settings.hierarchical else None,
                    codec=(
                        UnitCodec(codec, unit.flag_region)
                        if codec is not None and settings.codec_role
                        else None
                    ),
                    codec_role=settings.codec_role or "scatter",
                    keep_for_backward=options.reshard_after_forward
                    and not settings.gathers_for_backward(unit.name),
                    frozen=frozen,
                    planned_bwd_gather=settings.gathers_for_backward(unit.name),
                )
            )
        )
    device = next((u.shard.device for u in units), torch.device("cpu"))
    engine = Zero3Engine(
        units, module, options.reshard_after_forward, comm_streams(ctx.handle, device)
    )
    engine.observer = run_log
    return engine


def hook_units(module: nn.Module, engine: Zero3Engine) -> list[UnitState]:
    """Gather each block unit around its submodule's forward, and leave every unit (the
    module holds the sharded parameters then); the units without a submodule, which
    the module's own forward gathers for all of it."""
    whole_forward = []
    for state in engine.units:
        submodule = unit_submodule(module, state.layout.name)
        if submodule is None:
            whole_forward.append(state)
        else:
            _hook_unit(engine, submodule, state)
        engine.leave_unit(state)  # the module holds the sharded parameters now
    return whole_forward


def _hook_unit(engine: Zero3Engine, submodule: nn.Module, state: UnitState) -> None:
    submodule.register_forward_pre_hook(lambda _m, _a: engine.enter_unit(state))
    submodule.register_forward_hook(lambda _m, _a, out: engine.leave_unit(state, out))


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


def _gradient_maker(mesh: DTensorMesh) -> Callable[[nn.Parameter, torch.Tensor], torch.Tensor]:
    """A parameter's sharded gradient from its local shard ``local``."""

    def make_grad(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor) and local.dtype == param.dtype:
            # the parameter's own spec (mesh, placements, global shape and stride,
            # dtype), which _as_dtensor would rebuild, without DTensor.from_local's
            # autograd function: every parameter, every step (FSDP2 builds its sharded
            # gradients so too)
            return DTensor(local, param._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        return _as_dtensor(local, param, mesh)

    return make_grad


def _as_dtensor(local: torch.Tensor, like: torch.Tensor, mesh: DTensorMesh) -> DTensor:
    """``local`` as this rank's piece of a tensor shaped like ``like``: row-sharded, or
    replicated for a 0-dim one."""
    torch_mesh, placements = mesh
    chosen = placements if like.dim() else [Replicate()] * len(placements)
    return DTensor.from_local(
        local, torch_mesh, chosen, run_check=False, shape=like.shape, stride=like.stride()
    )


def _places(module: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Canonical parameter name -> every (module, attribute) that holds that parameter."""
    canonical = {id(p): name for name, p in module.named_parameters()}
    places: dict[str, list[tuple[nn.Module, str]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        places.setdefault(canonical[id(param)], []).append((owner, attr))
    return places
