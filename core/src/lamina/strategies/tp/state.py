"""A split model's state dict in whole-tensor terms: :class:`GlobalViews`.

A tensor-parallel parameter holds this rank's slice (and, composed with ``zero3`` /
``hsdp``, this rank's shard of that slice). In ``state_dict()`` each one is a ``DTensor``
of the whole tensor, under its own name: placed ``Shard`` on the tp axis on the dim it
is split on, and as its sharded strategy places it on the other axes. So
``torch.distributed.checkpoint`` saves and loads it across layouts (tp=2 x fsdp=2 into
tp=1 x fsdp=4, a full state dict) and ``set_model_state_dict`` loads a full one. The
local tensors are the parameters' own (in-place loads write into them); a fused
projection split block by block has no ``DTensor`` form: it is gathered whole into the
state dict (collective: every rank calls ``state_dict()``, as checkpointing does) and
its slice cut back out on load.

Dim-0 splits are ordered tp first then the sharded axes (rows ``[t * R / tp, ...)``
sharded again inside): the ``DTensor`` lives on a mesh of those axes in that order, built
once when the model is distributed (collective).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lamina.strategies.tp.activation_ops import TensorGroup
from lamina.strategies.tp.apply import shard_columns, shard_rows


@dataclass(frozen=True)
class ParamSplit:
    """How one parameter is split across the tp axis: on ``dim`` (0: rows, -1: the last
    dim), rows block by block (``parts``: the blocks' whole sizes; one block for a plain
    split, q, k and v for a fused projection), from a whole tensor of ``full_shape``."""

    dim: int
    parts: tuple[int, ...]
    full_shape: tuple[int, ...]

    @property
    def fused(self) -> bool:
        """Whether rows are split block by block (no ``DTensor`` form)."""
        return self.dim == 0 and len(self.parts) > 1


def _own_slice(mesh: TorchDeviceMesh, dims: tuple[str, ...]) -> TorchDeviceMesh:
    """This rank's sub-mesh over ``dims`` (the whole mesh when it has no other dim)."""
    if len(dims) == mesh.ndim:
        return mesh
    return mesh[dims]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, run = [], 1
    for size in reversed(shape):
        stride.append(run)
        run *= size
    return tuple(reversed(stride))


class GlobalViews:
    """State-dict values of the split parameters as whole-tensor ``DTensor``\\ s, and back
    (see the module)."""

    def __init__(self, splits: Mapping[str, ParamSplit], tp: TensorGroup) -> None:
        self.splits = dict(splits)
        self.tp = tp
        self.tp_mesh: TorchDeviceMesh | None = None
        #: (meshes with tp first, tp last), by the sharded mesh's dim names.
        self.combined: dict[tuple[str, ...], tuple[TorchDeviceMesh, TorchDeviceMesh]] = {}

    def attach(
        self,
        root: TorchDeviceMesh,
        tp_axis: str,
        sharded: TorchDeviceMesh | None,
        sharded_axes: tuple[str, ...] = (),
    ) -> None:
        """The meshes the views live on: ``root``'s tp axis, and (composed) tp beside
        the sharded strategy's mesh ``sharded`` over ``sharded_axes`` of ``root`` (their
        ranks in ``sharded``'s order, flattened as it is). Collective: group creation."""
        names = root.mesh_dim_names or ()
        self.tp_mesh = root[tp_axis]
        if sharded is None:
            return
        grid = root.mesh
        tp_dim = names.index(tp_axis)
        z_dims = [names.index(a) for a in sharded_axes]
        z_shape = tuple(sharded.mesh.shape)
        z_names = tuple(sharded.mesh_dim_names or ())
        # the axes of neither (a pipeline's) lead, and this rank's slice of them is kept
        rest = [d for d in range(grid.dim()) if d != tp_dim and d not in z_dims]
        rest_shape = [grid.shape[d] for d in rest]
        rest_names = tuple(names[d] for d in rest)
        first = grid.permute(*rest, tp_dim, *z_dims).reshape(*rest_shape, self.tp.size, *z_shape)
        last = grid.permute(*rest, *z_dims, tp_dim).reshape(*rest_shape, *z_shape, self.tp.size)
        device = root.device_type
        self.combined[z_names] = (
            _own_slice(
                TorchDeviceMesh(device, first, mesh_dim_names=(*rest_names, tp_axis, *z_names)),
                (tp_axis, *z_names),
            ),
            _own_slice(
                TorchDeviceMesh(device, last, mesh_dim_names=(*rest_names, *z_names, tp_axis)),
                (*z_names, tp_axis),
            ),
        )

    # saving
    def to_global(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` (this rank's piece of parameter ``name``) as the whole tensor's
        ``DTensor``; unsplit parameters unchanged."""
        split = self.splits.get(name)
        if split is None:
            return value
        if split.fused:
            whole = self._gather_whole(value, split)
            mesh, placements = self._mesh(value, 0, replicate=True)
            return DTensor.from_local(
                whole, mesh, placements, run_check=False, shape=whole.shape, stride=whole.stride()
            )
        mesh, placements = self._mesh(value, split.dim)
        local = value._local_tensor if isinstance(value, DTensor) else value
        return DTensor.from_local(
            local.detach(),
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(split.full_shape),
            stride=_contiguous_stride(split.full_shape),
        )

    def _mesh(
        self, value: torch.Tensor, dim: int, replicate: bool = False
    ) -> tuple[TorchDeviceMesh, list[Placement]]:
        tp_place: Placement = Replicate() if replicate else Shard(dim % value.dim())
        if not isinstance(value, DTensor):
            assert self.tp_mesh is not None
            return self.tp_mesh, [tp_place]
        z_names = tuple(value.device_mesh.mesh_dim_names or ())
        first, last = self.combined[z_names]
        inner = list(value.placements)
        if replicate:
            return last, [Replicate()] * (len(inner) + 1)
        if dim == 0:
            return first, [tp_place, *inner]
        return last, [*inner, tp_place]

    def _gather_whole(self, value: torch.Tensor, split: ParamSplit) -> torch.Tensor:
        """The whole tensor of a chunk-split parameter (collective over every rank)."""
        local = value.full_tensor() if isinstance(value, DTensor) else value
        local = local.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(parts, local, group=self.tp.group)
        local_sizes = [size // self.tp.size for size in split.parts]
        pieces = [torch.split(p, local_sizes, dim=0) for p in parts]  # rank -> its blocks
        blocks = [torch.cat([mine[b] for mine in pieces]) for b in range(len(split.parts))]
        return torch.cat(blocks).reshape(split.full_shape)

    # loading
    def to_local(self, name: str, value: Any, target: torch.Tensor) -> Any:
        """An incoming state-dict ``value`` of parameter ``name`` as the model before the
        views takes it: this rank's piece in ``target``'s form (a ``DTensor`` of the
        sharded strategy, or the plain slice), or, from a whole plain tensor, the tp
        slice (the sharded strategy cuts its rows)."""
        split = self.splits.get(name)
        if split is None or not isinstance(value, torch.Tensor):
            return value
        if isinstance(value, DTensor):
            ours = None if split.fused else self.to_global(name, target)
            if isinstance(ours, DTensor) and _same_layout(value, ours):
                return self._as_target(value._local_tensor, target)
            value = value.full_tensor()
        if tuple(value.shape) != split.full_shape:
            return value  # torch's load_state_dict names the shape mismatch
        whole = value.detach()
        if split.dim == 0:
            piece = shard_rows(whole, self.tp, split.parts)
        else:
            piece = shard_columns(whole, self.tp)
        if not isinstance(target, DTensor):
            return piece.contiguous()
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        rows = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        return self._as_target(piece[rows].contiguous().to(target.device), target)

    def _as_target(self, local: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not isinstance(target, DTensor):
            return local
        return DTensor.from_local(
            local,
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )


def _same_layout(a: DTensor, b: DTensor) -> bool:
    return (
        a.device_mesh == b.device_mesh
        and tuple(a.placements) == tuple(b.placements)
        and a.shape == b.shape
    )
