"""What ``"auto"`` reads of the model's Mixture-of-Experts layers: :func:`expert_profile`.

The MoE layers are found as expert parallelism finds them (:mod:`lamina.strategies.ep.find`:
stacked expert weights called with the tokens and their top-k expert ids), by one forward
without gradients on the example inputs. Each layer's token exchange (the bytes of its
``tokens x k`` assignments) and the bytes of every expert weight price expert
parallelism (:mod:`lamina.auto.predict`); a model without an MoE layer has no profile,
and ``ep`` is no candidate for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lamina.errors import ConfigError
from lamina.strategies.ep.find import find_moe_layers


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer at the example inputs' shape."""

    experts: int
    #: Bytes of its ``tokens x k`` assignments (each a hidden vector).
    exchange_bytes: int


@dataclass(frozen=True)
class ExpertProfile:
    """The MoE layers, read on ``rows`` rows, and the bytes of all their experts."""

    rows: int
    layers: tuple[ExpertLayer, ...]
    expert_bytes: int

    def to_json(self) -> dict[str, Any]:
        """Plain data."""
        return {
            "rows": self.rows,
            "layers": [
                {"experts": layer.experts, "exchange_bytes": layer.exchange_bytes}
                for layer in self.layers
            ],
            "expert_bytes": self.expert_bytes,
        }


def expert_profile(
    model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, rows: int
) -> ExpertProfile | None:
    """The MoE layers of one forward of ``model`` on ``inputs`` (``rows`` rows); None when
    it has none."""
    try:
        layers = find_moe_layers(model, lambda: model(*inputs, **(kwargs or {})))
    except ConfigError:
        return None
    expert_bytes = 0
    for layer in layers:
        module = model.get_submodule(layer.name)
        expert_bytes += sum(p.numel() * p.element_size() for p in module.parameters())
    return ExpertProfile(
        rows,
        tuple(
            ExpertLayer(
                layer.experts, layer.tokens * layer.top_k * layer.hidden * layer.dtype.itemsize
            )
            for layer in layers
        ),
        expert_bytes,
    )


__all__ = ["ExpertLayer", "ExpertProfile", "expert_profile"]
