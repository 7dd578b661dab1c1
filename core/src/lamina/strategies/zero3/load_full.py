"""``load_state_dict`` of a sharded model accepts a full (unsharded) state dict.

The parameters of a ``zero3`` / ``hsdp`` model are ``DTensor``\\ s; torch's
``load_state_dict`` copies each value into its parameter, and a plain ``torch.Tensor``
cannot be copied into a ``DTensor``. Every rank holding the whole state dict (a
checkpoint of the unsharded model read on every rank, ``model.state_dict()`` of the
model before ``lamina.distribute``), each plain value of a sharded parameter is cut to
this rank's rows here, locally, without a collective, and loaded as a ``DTensor`` with
the parameter's own placements. ``DTensor`` values (a sharded state dict, what
``torch.distributed.checkpoint`` loads) pass through unchanged. ``assign=True`` would
replace the parameters that are views of the shard buffers, and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lamina.errors import ConfigError


def sharded_state(
    module: nn.Module, state_dict: Mapping[str, Any], assign: bool, strategy: str
) -> dict[str, Any]:
    """``state_dict`` with each plain full value of a ``DTensor`` parameter replaced by
    this rank's part of it (see the module)."""
    if assign:
        raise ConfigError(
            f"load_state_dict(assign=True) would replace a {strategy} model's sharded "
            "parameters; load with assign=False (call model.to_empty(device=...) first on meta)"
        )
    targets = module.state_dict(keep_vars=True)
    out = dict(state_dict)
    for key, value in state_dict.items():
        target = targets.get(key)
        if (
            isinstance(target, DTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.shape == target.shape
        ):
            out[key] = _local_part(value, target)
    return out


def _local_part(value: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's rows of the whole ``value``, as a ``DTensor`` placed as ``like``."""
    shape, offset = compute_local_shape_and_global_offset(
        like.shape, like.device_mesh, like.placements
    )
    part = value.detach()[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    return DTensor.from_local(
        part.to(like.device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
