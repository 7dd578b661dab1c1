"""What the Fabric and the Trainer strategies share: the configuration (strategy names,
mesh, options) checked on construction, joining the job, distributing and materializing
the model, the collectives and the sharded checkpoints (torch.distributed.checkpoint)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import lamina
from lamina.errors import ConfigError
from lamina.session import LaunchEnv, MeshSpec, Runtime
from lamina.strategies.surface import PLACEMENT_KEY

#: The names registered in Fabric's and the Trainer's strategy registries, and the lamina
#: strategies each one distributes with.
REGISTERED: dict[str, tuple[str, ...]] = {
    "lamina_dp": ("dp",),
    "lamina_zero3": ("zero3",),
    "lamina_hsdp": ("hsdp",),
    "lamina_tp": ("tp",),
    "lamina_tp_zero3": ("tp", "zero3"),
    "lamina_tp_hsdp": ("tp", "hsdp"),
}
#: The file in a checkpoint directory holding what is not a tensor of the model or of an
#: optimizer (Lightning's own name for it, so its ``_is_sharded_checkpoint`` sees one).
METADATA_FILE = "meta.pt"
#: Strategies refused, each with why and what to do instead.
REFUSED = {
    "pp": (
        "'pp' runs its own schedule (loss = model.step(inputs, targets, loss_fn)), which "
        "Lightning's forward/backward loop cannot drive; train a pipeline in lamina's own loop "
        "(examples/train_gpt.py --strategy pp) or choose dp, zero3, hsdp or tp"
    ),
    "auto": (
        "'auto' chooses the strategy from timings taken inside distribute, before Lightning "
        "knows the model; run `lamina plan --auto --explain SCRIPT` and name the strategy "
        "it prints"
    ),
}


def strategy_names(strategy: str | Sequence[str]) -> tuple[str, ...]:
    """``strategy`` as a tuple of lamina strategy names, each one lamina knows; a
    ConfigError for an unknown or refused name (or an empty list)."""
    names = (strategy,) if isinstance(strategy, str) else tuple(strategy)
    if not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"LaminaStrategy({strategy!r}): give a strategy name such as 'zero3' or a list "
            "such as ['tp', 'zero3']"
        )
    from lamina.strategies.registry import strategies

    known = strategies()
    for name in names:
        if name in REFUSED:
            raise ConfigError(f"LaminaStrategy({strategy!r}): {REFUSED[name]}")
        if name not in known:
            usable = ", ".join(n for n in known if n not in REFUSED)
            raise ConfigError(
                f"LaminaStrategy({strategy!r}): unknown strategy {name!r}; choose one of "
                f"{usable} (or a list such as ['tp', 'zero3'])"
            )
    return names


def check_options(names: tuple[str, ...], options: Mapping[str, Any]) -> None:
    """A ConfigError naming an option none of ``names`` takes, and the valid ones."""
    from lamina.strategies.registry import strategies

    known = strategies()
    valid = sorted({o for n in names for o in known[n].options.names()})
    label = repr(names[0]) if len(names) == 1 else repr(list(names))
    for key in options:
        if key not in valid:
            raise ConfigError(
                f"LaminaStrategy({label}): no option {key!r}; lamina's strategies take "
                f"{', '.join(valid)}; LaminaStrategy itself mesh, init_weights (and module, "
                "in the Trainer)"
            )


def mesh_axes(spec: MeshSpec) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """(shape, or None where the world or the topology decides it; axis names) of a mesh
    spec; a ConfigError for one lamina does not take."""
    if spec == "flat":
        return None, ("dp",)
    if spec == "topology":
        return None, ("inter", "intra")
    if isinstance(spec, Mapping) and spec:
        return tuple(spec.values()), tuple(spec)
    if isinstance(spec, tuple) and len(spec) == 2:
        return tuple(spec[0]), tuple(spec[1])
    raise ConfigError(
        f"LaminaStrategy(mesh={spec!r}): use 'flat', 'topology', (shape, axis_names) or a "
        "dict such as {'fsdp': 2, 'tp': 2}"
    )


def default_mesh(names: tuple[str, ...], launch: LaunchEnv) -> MeshSpec:
    """The mesh a strategy runs on when none is given: tensor parallelism inside each
    node (the ranks one launcher started) and the sharding or replication across nodes,
    as Lightning's own ``ModelParallelStrategy`` places them; ``hsdp`` the topology's
    inter x intra; the rest the flat mesh."""
    if "tp" in names:
        tp = launch.local_world_size if names != ("tp",) else launch.world_size
        rest = launch.world_size // max(tp, 1)
        if "hsdp" in names:
            return {"dp": rest, "fsdp": 1, "tp": tp}
        if len(names) > 1:
            return {"fsdp": rest, "tp": tp}
        return {"tp": tp}
    if "hsdp" in names:
        return "topology"
    return "flat"


@dataclass
class LaminaConfig:
    """A LaminaStrategy's settings, checked on construction."""

    names: tuple[str, ...]
    mesh: MeshSpec | None
    options: dict[str, Any]
    init_weights: Callable[[nn.Module], None] | None = None
    module: str | None = None
    #: Set by :meth:`join`: the runtime the strategy runs on.
    runtime: Runtime | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        strategy: str | Sequence[str],
        mesh: MeshSpec | None,
        init_weights: Callable[[nn.Module], None] | None,
        module: str | None,
        options: Mapping[str, Any],
    ) -> LaminaConfig:
        """The settings from a LaminaStrategy's arguments; one-line ConfigErrors."""
        names = strategy_names(strategy)
        check_options(names, options)
        if mesh is not None:
            mesh_axes(mesh)
        if init_weights is not None and not callable(init_weights):
            raise ConfigError(
                f"LaminaStrategy(init_weights={init_weights!r}) is not callable; pass a "
                "function that initializes the model it is given"
            )
        return cls(names, mesh, dict(options), init_weights, module)

    @property
    def strategy(self) -> str | list[str]:
        """What ``lamina.distribute`` is given: a name, or a list that composes."""
        return self.names[0] if len(self.names) == 1 else list(self.names)

    def describe(self) -> str:
        """``LaminaStrategy(['tp', 'zero3'], mesh={'fsdp': 2, 'tp': 2})``-style text."""
        mesh = "" if self.mesh is None else f", mesh={self.mesh!r}"
        return f"LaminaStrategy({self.strategy!r}{mesh})"

    def mesh_for(self, launch: LaunchEnv) -> MeshSpec:
        """The mesh to join: the one given (its product checked against the world size),
        else :func:`default_mesh`."""
        if self.mesh is None:
            return default_mesh(self.names, launch)
        shape, _ = mesh_axes(self.mesh)
        if shape is not None and math.prod(shape) != launch.world_size:
            raise ConfigError(
                f"{self.describe()}: the mesh holds {math.prod(shape)} ranks but the job has "
                f"{launch.world_size}; give a mesh whose sizes multiply to {launch.world_size} "
                f"(or start {math.prod(shape)} ranks)"
            )
        return self.mesh

    def join(self) -> Runtime:
        """Join the job with ``lamina.init(mesh=...)`` (torchrun's environment; one process
        without it), or check that the runtime already joined has this mesh."""
        launch = LaunchEnv.from_environ()
        spec = self.mesh_for(launch)
        running = lamina.current()
        if running is None:
            self.runtime = lamina.init(mesh=spec)
            return self.runtime
        shape, names = mesh_axes(spec)
        if running.mesh.axis_names != names or (shape is not None and running.mesh.shape != shape):
            raise ConfigError(
                f"{self.describe()}: lamina already runs on {running.mesh}; call "
                "lamina.shutdown() before this Fabric/Trainer starts, or give LaminaStrategy "
                "that mesh"
            )
        self.runtime = running
        return running


def launch_env() -> LaunchEnv:
    """Where this process sits in the job (torchrun's variables; one process without)."""
    return LaunchEnv.from_environ()


def launched() -> bool:
    """Whether a launcher (torchrun, ``lamina run``) started this process."""
    return "RANK" in os.environ or "LOCAL_RANK" in os.environ


def lamina_devices(launch: LaunchEnv) -> list[torch.device] | None:
    """The devices of this node's ranks on the backend ``lamina.init`` will pick
    (``$LAMINA_BACKEND``, else the best available), so that Lightning chooses the matching
    accelerator; None for a device type Lightning's own accelerators do not name, and in
    a process no launcher started (Lightning's ``devices`` then says how many were asked
    for, which :func:`check_launched` checks)."""
    if not launched():
        return None
    from lamina.plugins import get_registry

    device_type = get_registry().select_backend().device_type
    if device_type == "cpu":
        return [torch.device("cpu")] * max(launch.local_world_size, 1)
    if device_type == "cuda":
        return [torch.device("cuda", i) for i in range(max(launch.local_world_size, 1))]
    return None


def node_rank(launch: LaunchEnv) -> int:
    """This process's node: torchrun's ``GROUP_RANK`` (or ``NODE_RANK``), else its rank
    over the ranks per node."""
    for name in ("GROUP_RANK", "NODE_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return launch.rank // max(launch.local_world_size, 1)


def check_launched(parallel_devices: Sequence[torch.device] | None) -> None:
    """A ConfigError when more than one device is asked of one process that no launcher
    started: lamina's ranks are started by torchrun or ``lamina run``, never by Lightning."""
    count = len(parallel_devices or ())
    if count > 1 and not launched():
        raise ConfigError(
            f"LaminaStrategy runs in processes started by torchrun or `lamina run`, not by "
            f"Lightning: start the script with `lamina run --nproc-per-node {count} "
            "SCRIPT` (or `torchrun --nproc-per-node ...`)"
        )


def is_distributed(module: nn.Module) -> bool:
    """Whether lamina has distributed ``module`` (it carries a placement)."""
    return PLACEMENT_KEY in module.__dict__


def pipelined(module: nn.Module) -> bool:
    """Whether ``module`` runs a pipeline schedule (``model.step``)."""
    return "lamina_pp" in module.__dict__


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(_local(t).is_meta for t in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return cast(torch.Tensor, to_local()) if to_local is not None else tensor


def distribute(
    module: nn.Module,
    config: LaminaConfig,
    device: torch.device,
    example_inputs: tuple[Any, ...] | None = None,
) -> nn.Module:
    """``lamina.distribute(module, strategy, **options)`` on the joined runtime, then,
    for a module built on the meta device, ``to_empty`` on ``device`` (each rank
    allocates its own pieces) and the initializers (:func:`initialize`). ``example_inputs``
    is the fallback tensor parallelism derives its split from when the options give
    none. A module lamina already distributed is returned as it is."""
    if is_distributed(module):
        return module
    options = dict(config.options)
    if "tp" in config.names and options.get("example_inputs") is None:
        if example_inputs is None:
            raise ConfigError(
                f"{config.describe()}: tp derives its split from one forward; pass "
                "LaminaStrategy(..., example_inputs=(batch,)) with a batch the model takes"
            )
        options["example_inputs"] = example_inputs
    meta = on_meta(module)
    uninitialized = _without_initializer(module) if meta else []
    if meta and config.init_weights is None and uninitialized:
        name, kind = uninitialized[0]
        raise ConfigError(
            f"{config.describe()}: {name or 'the model'} ({kind}) was built on the meta device "
            "and has no reset_parameters(); pass LaminaStrategy(..., init_weights=fn) where "
            "fn(model) initializes every parameter"
        )
    distributed = lamina.distribute(module, config.strategy, runtime=config.runtime, **options)
    if pipelined(distributed):  # "auto" or a plugin's strategy that pipelines
        raise ConfigError(f"{config.describe()}: {REFUSED['pp']}")
    if meta:
        distributed.to_empty(device=device)
        initialize(distributed, config.init_weights)
    return distributed


def _without_initializer(module: nn.Module) -> list[tuple[str, str]]:
    """(name, class) of each submodule holding parameters of its own on the meta device
    without a ``reset_parameters()``."""
    missing = []
    for name, sub in module.named_modules():
        own = [*sub.parameters(recurse=False)]
        if (
            own
            and any(_local(p).is_meta for p in own)
            and not callable(getattr(sub, "reset_parameters", None))
        ):
            missing.append((name, type(sub).__name__))
    return missing


@torch.no_grad()
def initialize(module: nn.Module, init_weights: Callable[[nn.Module], None] | None) -> None:
    """Initialize a module ``to_empty`` left uninitialized: ``init_weights(module)``, else
    ``reset_parameters()`` on each submodule that has one (on the shards: lamina gives them
    the bits an unsharded initialization would)."""
    if init_weights is not None:
        init_weights(module)
        return
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()


def owned_child(parent: nn.Module, name: str | None) -> tuple[str, nn.Module]:
    """The submodule of ``parent`` a Trainer's strategy distributes: the one ``name``
    gives (a dotted path), else the only direct child holding parameters."""
    if name is not None:
        try:
            return name, parent.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in parent.named_children()]
            raise ConfigError(
                f"LaminaStrategy(module={name!r}): {type(parent).__name__} has no submodule "
                f"{name!r}; its children are {', '.join(children) or 'none'}"
            ) from None
    holders = [(n, c) for n, c in parent.named_children() if any(True for _ in c.parameters())]
    own = [n for n, _ in parent.named_parameters(recurse=False)]
    if len(holders) == 1 and not own:
        return holders[0]
    found = ", ".join([*(repr(n) for n, _ in holders), *(f"{n!r} (its own)" for n in own)])
    raise ConfigError(
        f"LaminaStrategy: {type(parent).__name__} holds parameters in {found or 'nothing'}; "
        "keep the network in one child module (self.model = ...) or pass "
        "LaminaStrategy(..., module='name') naming the one to distribute"
    )


def remap_optimizer(
    optimizer: torch.optim.Optimizer, before: Mapping[int, str], module: nn.Module
) -> None:
    """Point ``optimizer`` at ``module``'s parameters after distribution replaced them
    (ZeRO-3's shards, tensor-parallel slices): ``before`` maps each old parameter's id to
    its name. A ConfigError when the optimizer has stepped already."""
    if optimizer.state:
        raise ConfigError(
            f"LaminaStrategy: the {type(optimizer).__name__} has stepped before setup; set up "
            "the model and optimizer before the first step (fabric.setup(model, optimizer))"
        )
    now = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [now.get(before.get(id(p), ""), p) for p in group["params"]]


# --- collectives ----------------------------------------------------------------------

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def _running(group: Any = None) -> bool:
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1)


def all_reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """``tensor`` reduced over ``group`` (the world by default): ``"mean"`` (the
    default), ``"sum"``, ``"max"``, ``"min"``, ``"product"`` or a ``ReduceOp``; anything
    but a tensor is returned as it is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    named = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    mean = reduce_op is None or named
    if isinstance(reduce_op, str):
        op = _OPS.get(reduce_op.lower())
        if op is None:
            raise ConfigError(
                f"reduce_op {reduce_op!r} is not a reduction; use one of {', '.join(_OPS)}"
            )
    else:
        op = dist.ReduceOp.SUM if reduce_op is None else reduce_op
    if not _running(group):
        return tensor
    out = tensor.detach().clone().contiguous()
    dist.all_reduce(out, op=op, group=group)
    if mean:
        out = out / dist.get_world_size(group)
    return out


def all_gather(tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
    """Every rank's ``tensor`` (equal shapes) stacked in rank order: ``(world, *shape)``;
    with ``sync_grads`` the gradient flows back to each rank's own."""
    if not _running(group):
        return tensor
    tensor = tensor.contiguous()
    if sync_grads:
        from torch.distributed.nn.functional import all_gather as gather_with_grad

        gathered = gather_with_grad(tensor, group=group or dist.group.WORLD)  # type: ignore[no-untyped-call]
        return torch.stack(list(gathered))
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.stack(parts)


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (any picklable object)."""
    if not _running():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Every rank waits for the others."""
    if _running():
        dist.barrier()


def no_sync(module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
    """``module.no_sync()`` (lamina's accumulation) when ``enabled``, else nothing."""
    if not enabled:
        return nullcontext()
    if not is_distributed(module):
        raise ConfigError(
            "LaminaStrategy: no_backward_sync needs the model lamina distributed; set it up "
            "first (fabric.setup(model, ...))"
        )
    return cast(AbstractContextManager[Any], module.no_sync())  # type: ignore[operator]


def clip_grad_norm(
    module: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """The whole model's gradient norm clipped through ``module.clip_grad_norm_`` (every
    shard, tensor-parallel slice and tied weight counted once, whatever the composition)."""
    if not is_distributed(module):
        raise ConfigError(
            f"LaminaStrategy: {type(module).__name__} was not distributed by lamina; clip the "
            "gradients of the model set up through the strategy"
        )
    clip = cast(Callable[..., torch.Tensor], module.clip_grad_norm_)
    return clip(float(max_norm), float(norm_type), error_if_nonfinite)


# --- checkpoints ----------------------------------------------------------------------


def _state_options(module: nn.Module) -> StateDictOptions | None:
    options = getattr(module, "checkpoint_state_options", None)
    return options if isinstance(options, StateDictOptions) else None


def model_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state dict as DCP saves it (sharded: each rank its own pieces)."""
    return get_model_state_dict(module, options=_state_options(module))


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by ``module``'s parameter names, each split parameter's
    state as a whole-tensor DTensor (what its parameter is in ``state_dict()``)."""
    state = get_optimizer_state_dict(module, optimizer, options=_state_options(module))
    to_global = getattr(module, "optimizer_state_to_global", None)
    return cast(dict[str, Any], to_global(state)) if to_global is not None else state


def load_model_state(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Put a loaded :func:`model_state` back into ``module``."""
    options = _state_options(module) or StateDictOptions()
    options = StateDictOptions(**{**options.__dict__, "strict": strict})
    set_model_state_dict(module, state, options=options)


def load_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put a loaded :func:`optimizer_state` back into ``optimizer``."""
    to_local = getattr(module, "optimizer_state_to_local", None)
    local = to_local(state) if to_local is not None else state
    set_optimizer_state_dict(module, optimizer, local, options=_state_options(module))


def owner_of(optimizer: torch.optim.Optimizer, modules: Mapping[str, nn.Module]) -> nn.Module:
    """The module among ``modules`` holding ``optimizer``'s parameters."""
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in modules.values():
        if wanted & {id(p) for p in module.parameters()}:
            return module
    raise ConfigError(
        "LaminaStrategy: an optimizer is saved or loaded without the model it trains; put "
        "both in the state: {'model': model, 'optimizer': optimizer, ...}"
    )


def save_sharded(path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """A checkpoint directory: ``tensors`` through ``dcp.save`` (each rank writes its own
    pieces), ``metadata`` (the rest) in ``meta.pt`` from rank 0."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
    barrier()
    dcp_save(tensors, checkpoint_id=str(path))
    if rank == 0:
        torch.save(metadata, path / METADATA_FILE)
    barrier()


def load_sharded(
    path: Path, tensors: dict[str, Any], weights_only: bool | None = None
) -> dict[str, Any]:
    """Fill ``tensors`` (state dicts shaped as this job holds them) from the checkpoint
    directory ``path`` (DCP reshards them); returns its metadata."""
    if not (path / METADATA_FILE).is_file():
        raise ConfigError(
            f"LaminaStrategy: {path} is not a checkpoint LaminaStrategy saved (no "
            f"{METADATA_FILE} in it); give the directory fabric.save / the Trainer wrote"
        )
    if tensors:
        dcp_load(tensors, checkpoint_id=str(path))
    return cast(dict[str, Any], torch.load(path / METADATA_FILE, weights_only=weights_only))


@contextmanager
def meta_init(enabled: bool | None) -> Iterator[None]:
    """The meta device when ``enabled`` (modules built there are materialized on
    distribution), else nothing."""
    with torch.device("meta") if enabled else nullcontext():
        yield


__all__ = [
    "METADATA_FILE",
    "REGISTERED",
    "LaminaConfig",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "check_launched",
    "clip_grad_norm",
    "default_mesh",
    "distribute",
    "initialize",
    "is_distributed",
    "lamina_devices",
    "launch_env",
    "launched",
    "load_model_state",
    "load_optimizer_state",
    "load_sharded",
    "meta_init",
    "model_state",
    "no_sync",
    "node_rank",
    "on_meta",
    "optimizer_state",
    "owned_child",
    "owner_of",
    "remap_optimizer",
    "save_sharded",
    "strategy_names",
]
