"""State dicts of a ZeRO-3 model: full (for export) and sharded (for torch.distributed.checkpoint).

The full form has the original module's keys and shapes (tied parameters under every
name, as ``nn.Module.state_dict`` gives them), gathered from the shards onto the CPU.
The sharded form holds each unit's flat shard as a DTensor sharded along dim 0 over the
data-parallel group, keyed ``"units.<index>.<unit name>"``, plus the shard layout as
plain data under ``"layout"`` and the module's own state (buffers, parameters outside
the layout) under ``"module.<name>"``; ``dcp.save`` / ``dcp.load`` store it as is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.errors import ConfigError
from lamina.memory.layout import ShardLayout

if TYPE_CHECKING:
    from lamina.memory.engine import UnitState
    from lamina.strategies.zero3.wrapper import ShardedDataParallel

#: Key of the shard layout (plain data) in a sharded state dict.
LAYOUT_KEY = "layout"
#: Prefix of the module's own (unsharded) state in a sharded state dict.
MODULE_PREFIX = "module."


def unit_key(index: int, name: str) -> str:
    """Key of one unit's flat shard in a sharded state dict."""
    return f"units.{index}.{name}"


def _aliases(model: ShardedDataParallel, state: UnitState) -> dict[str, list[str]]:
    """Canonical parameter name -> every qualified name it has in the original module."""
    prefixes: dict[int, list[str]] = {}
    for name, module in model.module.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(module), []).append(f"{name}." if name else "")
    out: dict[str, list[str]] = {}
    for pname, places in state.places.items():
        names = out.setdefault(pname, [pname])
        for owner, attr in places:
            for prefix in prefixes.get(id(owner), []):
                if prefix + attr not in names:
                    names.append(prefix + attr)
    return out


def _gathered_units(
    model: ShardedDataParallel,
) -> Iterator[tuple[UnitState, dict[str, torch.Tensor]]]:
    """Each unit with views of its full parameters (gathered: collective on every rank)."""
    for state in model.engine.units:
        yield state, state.layout.views(state.gather_master())


def full_state_dict(
    model: ShardedDataParallel, *, rank0_only: bool = True
) -> dict[str, torch.Tensor]:
    """Every parameter (original names and shapes) and buffer of ``model``, on the CPU.

    Gathers every unit, so every rank of the job must call it. With ``rank0_only`` (the
    default) every rank but global rank 0 gets ``{}``.
    """
    keep = not rank0_only or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for state, views in _gathered_units(model):
        if not keep:
            continue
        for pname, names in _aliases(model, state).items():
            value = views[pname].detach().to("cpu", copy=True)
            for name in names:
                out[name] = value
    if not keep:
        return {}
    for name, tensor in model.module.state_dict().items():
        out[name] = tensor.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(model: ShardedDataParallel, state: Mapping[str, torch.Tensor]) -> None:
    """Set this rank's shards, buffers and unsharded parameters from a full state dict.

    Every rank passes the full dict (as :func:`full_state_dict` with
    ``rank0_only=False`` gives it) and keeps its own slice; no collectives.
    """
    rank = dist.get_rank(model.group)
    taken: set[str] = set()
    for unit_state, shard in zip(model.engine.units, model.shards, strict=True):
        chosen: dict[str, torch.Tensor] = {}
        for pname, names in _aliases(model, unit_state).items():
            found = [n for n in names if n in state]
            if not found:
                raise ConfigError(
                    f"full state dict has no entry for parameter {pname!r}; "
                    "pass a state dict of the same model"
                )
            chosen[pname] = state[found[0]]
            taken.update(names)
        layout = unit_state.layout
        flat = layout.flatten(chosen, out=torch.empty(layout.total_numel, dtype=layout.torch_dtype))
        with torch.no_grad():
            shard.copy_(layout.shard_of(flat, rank))
    rest = {k: v for k, v in state.items() if k not in taken}
    _load_module_state(model.module, rest, "full state dict")


def _load_module_state(module: nn.Module, rest: Mapping[str, torch.Tensor], what: str) -> None:
    missing, unexpected = module.load_state_dict(dict(rest), strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{what} does not match the model: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}; save and load the same model"
        )


def _mesh(model: ShardedDataParallel) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    group = model.group if model.group is not None else dist.group.WORLD
    if group is None:
        raise ConfigError("sharded state dicts need torch.distributed; call lamina.init() first")
    device = model.shards[0].device.type if len(model.shards) else "cpu"
    return DeviceMesh.from_group(group, device)


def sharded_state_dict(model: ShardedDataParallel) -> dict[str, Any]:
    """This rank's shards as DTensors, the layout and the module's own state, for DCP.

    The DTensors share storage with ``model.shards``, so ``dcp.load`` into this dict
    fills the model directly; call :func:`load_sharded_state_dict` after it anyway.
    """
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh(model)
    out: dict[str, Any] = {}
    for unit_state, shard in zip(model.engine.units, model.shards, strict=True):
        layout = unit_state.layout
        out[unit_key(layout.index, layout.name)] = DTensor.from_local(
            shard.detach(), mesh, [Shard(0)], run_check=False
        )
    out[LAYOUT_KEY] = model.layout.to_json()
    for name, tensor in model.module.state_dict().items():
        out[MODULE_PREFIX + name] = tensor.detach()
    return out


def load_sharded_state_dict(model: ShardedDataParallel, state: Mapping[str, Any]) -> None:
    """Copy a sharded state dict (after ``dcp.load``) into the model's shards and buffers.

    The stored layout must be the model's (same units, offsets, world size, alignment).
    """
    stored = state.get(LAYOUT_KEY)
    if not isinstance(stored, Mapping):
        raise ConfigError(
            f"sharded state dict has no {LAYOUT_KEY!r} entry; save it with sharded_state_dict()"
        )
    theirs, ours = ShardLayout.from_json(stored).fingerprint(), model.layout.fingerprint()
    if theirs != ours:
        raise ConfigError(
            f"checkpoint shard layout {theirs[:16]} differs from the model's {ours[:16]}; load "
            "with the same model, world size and alignment (resharding is the checkpoint "
            "layer's job)"
        )
    for unit_state, shard in zip(model.engine.units, model.shards, strict=True):
        layout = unit_state.layout
        key = unit_key(layout.index, layout.name)
        if key not in state:
            raise ConfigError(f"sharded state dict has no {key!r}; save the same model")
        value = state[key]
        local = value.to_local() if hasattr(value, "to_local") else value
        with torch.no_grad():
            shard.copy_(local)
    rest = {
        k.removeprefix(MODULE_PREFIX): v for k, v in state.items() if k.startswith(MODULE_PREFIX)
    }
    _load_module_state(model.module, rest, "sharded state dict")
