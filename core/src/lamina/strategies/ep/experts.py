"""The experts of the transformers 5 layout on one rank: :class:`StackedExperts`.

transformers 5 keeps an MoE layer's experts as stacked weights (Mixtral, Qwen3-MoE:
``gate_up_proj`` of ``(experts, 2 x intermediate, hidden)`` and ``down_proj`` of
``(experts, hidden, intermediate)``) and calls them with the tokens, each token's top-k
expert ids and their weights. :class:`StackedExperts` holds this rank's slice of those
weights (experts ``first`` to ``first + local``) and computes its experts' tokens, each
expert's in one call (a loop over the local experts, not over tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class StackedExperts(nn.Module):
    """This rank's experts of a stacked layer (see the module); ``act``: the activation
    of the gate half."""

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        first: int,
        local: int,
        act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj[first : first + local].detach().clone())
        self.down_proj = nn.Parameter(down_proj[first : first + local].detach().clone())
        self.act = act

    def forward(self, tokens: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """``tokens`` grouped by local expert, ``per_expert[e]`` rows for expert ``e``."""
        return grouped_experts(self.gate_up_proj, self.down_proj, self.act, tokens, per_expert)


def grouped_experts(
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    per_expert: list[int],
) -> torch.Tensor:
    """Stacked experts (``gate_up_proj[e]``, ``down_proj[e]``) on ``tokens`` grouped by
    expert, ``per_expert[e]`` rows for expert ``e``: one call per expert."""
    outs = []
    for e, part in enumerate(torch.split(tokens, per_expert)):
        gate, up = F.linear(part, gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down_proj[e]))
    if not outs:
        return tokens.new_zeros((0, down_proj.shape[1]))
    return torch.cat(outs)


__all__ = ["StackedExperts", "grouped_experts"]
