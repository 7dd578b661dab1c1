"""What every distributed model offers a training loop, whatever its strategy or
composition: :class:`DistributedModule`.

``clip_grad_norm_`` (torch's semantics, across every shard, slice and stage), ``no_sync()``
and ``data_replica`` (this rank's share of the data), all read from the model's
:class:`~lamina.runtime.placement.ModelPlacement`, which :func:`lamina.distribute` sets as
each strategy places the model (:func:`place_model`). So a loop never does mesh
arithmetic, and its lines stay the same when the strategy changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lamina.device.mesh import DeviceMesh
from lamina.errors import ConfigError
from lamina.runtime.placement import (
    AxisPlacement,
    ModelPlacement,
    Replicate,
    Role,
    Shard,
    Stage,
)
from lamina.strategies.grad_norm import clip_grad_norm

#: Where a distributed model keeps its placement (its ``__dict__``: plain state).
PLACEMENT_KEY = "lamina_placement"
#: Where it keeps this rank's mesh coordinates (its data replica follows from them).
COORDINATES_KEY = "lamina_coordinates"
#: Where a sharder composed after a pipeline declares what gathers the stages for a whole
#: step (``pp``'s engine reads it at each step; :class:`lamina.memory.WholeStepGather`).
STEP_SHARDING_KEY = "lamina_step_sharding"
#: Where a strategy applied before a pipeline lists what it syncs once per step (``ep``'s
#: gradient averages): ``pp``'s engine runs each after the step's gradients are summed
#: over the microbatches and sharded, instead of after every microbatch's backward.
STEP_SYNCS_KEY = "lamina_step_syncs"
#: Where a pipeline composed after another strategy keeps its state on the model.
PIPELINE_KEY = "lamina_pp"


@dataclass(frozen=True)
class DataReplica:
    """This rank's share of the data: replica ``index`` of ``count`` (ranks that see the
    same batch, a tensor-parallel group or a pipeline, share one index); unpacks as
    ``index, count = model.data_replica``."""

    index: int
    count: int

    def __iter__(self) -> Iterator[int]:
        return iter((self.index, self.count))


class DistributedModule(nn.Module):
    """The training surface every strategy's model class derives from (see the module)."""

    @property
    def placement(self) -> ModelPlacement:
        """Where every parameter lives on the mesh, and the roles that placed it."""
        return placement_of(self)

    @property
    def data_replica(self) -> DataReplica:
        """This rank's data replica (index, count): give it
        ``dataset[index::count]``-style shares (``lamina.EpochSampler`` takes them)."""
        coordinates = self.__dict__.get(COORDINATES_KEY, {})
        index, count = placement_of(self).replica(coordinates)
        return DataReplica(index, count)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the gradients so that the whole model's gradient norm (as
        ``torch.nn.utils.clip_grad_norm_`` computes it in one process: every shard,
        tensor-parallel slice and pipeline stage, a tied weight once) is at most
        ``max_norm``; returns that norm, the same on every rank. ``norm_type`` may be
        ``float('inf')``. Collective where ranks hold different pieces: call it on every
        rank."""
        return clip_grad_norm(self, placement_of(self), max_norm, norm_type, error_if_nonfinite)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients for a later optimizer step. Where
        the strategy can defer its gradient sync (``dp``) it does; elsewhere each backward
        still syncs (ZeRO-3 reduce-scatters into the shards' gradients, which
        accumulate), so the sum is the same either way."""
        yield


def role_default(role: str, coordinate: int) -> AxisPlacement:
    """A parameter's placement on an axis of ``role`` unless the strategy says otherwise:
    sharded rows (``shard``), held by this rank's stage (``pipeline``, at ``coordinate``),
    else replicated (a split leaves the tensors it does not cut whole)."""
    if role == "shard":
        return Shard(0)
    if role == "pipeline":
        return Stage((coordinate,))
    return Replicate()


def placement_of(model: nn.Module) -> ModelPlacement:
    """``model``'s placement; a ConfigError when no strategy placed it."""
    held = model.__dict__.get(PLACEMENT_KEY)
    if not isinstance(held, ModelPlacement):
        raise ConfigError(
            f"this {type(model).__name__} has no placement; distribute it with "
            "lamina.distribute(model, strategy) first"
        )
    return held


def placed_before(model: nn.Module, strategy: str) -> bool:
    """Whether a strategy other than ``strategy`` placed ``model`` already (it was
    composed before: a split that made the ranks agree and cut the model)."""
    held = model.__dict__.get(PLACEMENT_KEY)
    return isinstance(held, ModelPlacement) and any(r.strategy != strategy for r in held.roles)


def place_model(
    model: nn.Module,
    mesh: DeviceMesh,
    held: ModelPlacement | None,
    roles: tuple[Role, ...],
    per_param: dict[str, dict[str, AxisPlacement]],
    default: dict[str, AxisPlacement],
) -> ModelPlacement:
    """``held`` (what earlier strategies placed; None: a fresh placement on ``mesh``)
    with ``roles`` added: each parameter of ``model`` placed as ``per_param`` says on
    the roles' axes, else per axis as ``default`` says. Stored on the model (with this
    rank's mesh coordinates) and returned."""
    placement = held or ModelPlacement(tuple((a, mesh.size(a)) for a in mesh.axis_names))
    names = [n for n, _ in model.named_parameters()]
    for role in roles:
        given = {
            n: {a: w for a, w in per_param.get(n, {}).items() if a in role.axes} for n in names
        }
        filled = {n: {a: g.get(a, default[a]) for a in role.axes} for n, g in given.items()}
        placement = placement.placed(role, filled)
    model.__dict__[PLACEMENT_KEY] = placement
    model.__dict__[COORDINATES_KEY] = mesh.coordinates()
    return placement


__all__ = [
    "COORDINATES_KEY",
    "PIPELINE_KEY",
    "PLACEMENT_KEY",
    "STEP_SHARDING_KEY",
    "STEP_SYNCS_KEY",
    "DataReplica",
    "DistributedModule",
    "place_model",
    "placed_before",
    "placement_of",
    "role_default",
]
