"""Finding the shard layout's names in the model: a unit's submodule, a parameter by
its dotted name."""

from __future__ import annotations

import torch
from torch import nn

from lamina.memory.units import ROOT_UNIT


def unit_submodule(module: nn.Module, name: str) -> nn.Module | None:
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


def parameter(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter of ``module`` at the dotted ``name``, as its owner holds it now."""
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    tensor: torch.Tensor = getattr(owner, attr)
    return tensor
