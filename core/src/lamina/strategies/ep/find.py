"""Which modules of a model are Mixture-of-Experts layers: :func:`find_moe_layers`.

An MoE layer's experts are found in the transformers 5 layout: a module whose
parameters ``gate_up_proj`` and ``down_proj`` stack one weight per expert on dim 0
(Mixtral, Qwen3-MoE, ...) and whose forward takes the tokens, each token's top-k expert
ids and their weights. One forward on the example inputs, without gradients, confirms
each such module is called so and reads its top-k; a module that is never called (or
called otherwise) is not an MoE layer. A model with none is a one-line error naming
what ``"ep"`` looks for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lamina.errors import ConfigError


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer's experts module, as a forward called it."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    #: Rows of tokens one forward of the example batch gave it, and their dtype.
    tokens: int = 0
    dtype: torch.dtype = torch.float32
    #: Assignments this rank's example batch routed to each expert.
    routed: tuple[int, ...] = ()

    def describe(self) -> str:
        return (
            f"{self.name}: {self.experts} experts ({self.hidden} -> {self.intermediate}), "
            f"top-{self.top_k}"
        )


def _stacked(module: nn.Module) -> tuple[int, int, int] | None:
    """(experts, hidden, intermediate) of a module holding stacked expert weights."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return None
    if getattr(module, "is_transposed", False):  # (experts, hidden, 2 x intermediate)
        return int(gate_up.shape[0]), int(gate_up.shape[1]), int(down.shape[1])
    return int(gate_up.shape[0]), int(gate_up.shape[2]), int(down.shape[2])


def stacked_modules(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """The modules of ``model`` holding stacked expert weights, by name: (experts,
    hidden, intermediate)."""
    return {name: shape for name, m in model.named_modules() if (shape := _stacked(m))}


def find_moe_layers(model: nn.Module, run: Callable[[], Any]) -> tuple[MoeLayer, ...]:
    """The MoE layers of ``model`` (see the module); ``run`` calls its forward on the
    example inputs."""
    shapes = stacked_modules(model)
    if not shapes:
        raise ConfigError(
            "strategy 'ep' found no Mixture-of-Experts layer in the model: it looks for an "
            "experts module holding one weight per expert stacked on dim 0 (gate_up_proj and "
            "down_proj, as transformers 5 stores Mixtral's and Qwen3-MoE's) called with the "
            "tokens, their top-k expert ids and weights; use a strategy without 'ep'"
        )
    seen: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
    handles = []
    for name in shapes:

        def called(_m: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            index = args[1] if len(args) >= 3 else None
            # the expert ids (integers), not the weights
            if (
                isinstance(index, torch.Tensor)
                and index.dim() == 2
                and not index.is_floating_point()
            ):
                hidden = args[0]
                routed = torch.bincount(index.reshape(-1).cpu(), minlength=shapes[name][0])
                seen[name] = (
                    int(index.shape[1]),
                    int(hidden.shape[0]),
                    hidden.dtype,
                    tuple(int(c) for c in routed.tolist()),
                )

        handles.append(model.get_submodule(name).register_forward_pre_hook(called))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    layers = tuple(
        MoeLayer(name, *shapes[name], top_k=k, tokens=rows, dtype=dtype, routed=routed)
        for name in shapes
        if name in seen
        for k, rows, dtype, routed in (seen[name],)
    )
    if not layers:
        raise ConfigError(
            f"strategy 'ep': the modules holding stacked expert weights ({', '.join(shapes)}) "
            "were not called with (tokens, top-k expert ids, top-k weights) in the forward; "
            "ep replaces such an experts call"
        )
    return layers


__all__ = ["MoeLayer", "find_moe_layers", "stacked_modules"]
