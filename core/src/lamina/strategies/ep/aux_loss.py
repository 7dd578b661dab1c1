"""The router's load-balancing loss over the global batch: :func:`global_balance_loss`.

transformers' MoE models add ``coef x E x sum_e f_e P_e`` to the loss (Switch
Transformer), where ``f_e`` is the share of top-k assignments expert ``e`` got and
``P_e`` its mean router probability, both over the batch. Computed on each rank's own
batch, the average over ranks of those products is not the global product. Here the
assignment counts and the row count are summed over the job's data replicas first (one
all-reduce, no gradient: they come from a top-k), and each rank's probability sums enter
scaled by the replicas ``N``: ``L_r = E x sum_e (T_e / R) (N P_e^r / R)`` with ``T``
and ``R`` global. The mean of ``L_r`` over the ranks, which the gradients' average
takes, is then exactly the one-process loss, value and gradient.

:func:`use_global_balance_loss` installs it in place of a transformers model's
``load_balancing_loss_func`` (the module global its forward calls), active only while an
expert-parallel model's forward runs (:func:`balancing_over`); any other model of the
process keeps the original.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.strategies.ep.dispatch import Issuing

#: The module global transformers' MoE models compute the loss with.
LOSS_FUNCTION = "load_balancing_loss_func"
#: The plan node of the counts' all-reduce.
AUX_NODE = "moe.aux_counts"


@dataclass(frozen=True)
class BalanceGroup:
    """The data replicas the loss is computed over: their group, how many, and where
    the all-reduce is announced."""

    group: dist.ProcessGroup | None
    replicas: int
    issuing: Issuing


_ACTIVE: ContextVar[BalanceGroup | None] = ContextVar("lamina_ep_balance", default=None)


@contextmanager
def balancing_over(group: BalanceGroup | None) -> Iterator[None]:
    """Inside the block, the installed loss is computed over ``group`` (None: as the
    model's own function does)."""
    token = _ACTIVE.set(group)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def use_global_balance_loss(model: nn.Module) -> bool:
    """Install the global loss in ``model``'s modeling module; False when the model has no
    such function (its forward computes no load-balancing loss lamina knows)."""
    # the model's own class (a strategy composed before may have extended it)
    module = next(
        (
            found
            for cls in type(model).__mro__
            if callable(getattr(found := sys.modules.get(cls.__module__), LOSS_FUNCTION, None))
        ),
        None,
    )
    original = getattr(module, LOSS_FUNCTION, None)
    if module is None or not callable(original):
        return False
    if getattr(original, "lamina_global", False):
        return True
    setattr(module, LOSS_FUNCTION, _switched(original))
    return True


def _switched(original: Callable[..., Any]) -> Callable[..., Any]:
    def loss(
        gate_logits: Any,
        num_experts: int | None = None,
        top_k: int = 2,
        attention_mask: torch.Tensor | None = None,
    ) -> Any:
        group = _ACTIVE.get()
        if group is None or not isinstance(gate_logits, tuple) or num_experts is None:
            return original(gate_logits, num_experts, top_k, attention_mask)
        return global_balance_loss(gate_logits, num_experts, top_k, attention_mask, group)

    loss.lamina_global = True  # type: ignore[attr-defined]
    loss.__doc__ = original.__doc__
    return loss


def global_balance_loss(
    gate_logits: tuple[torch.Tensor, ...],
    experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
    group: BalanceGroup,
) -> torch.Tensor:
    """This rank's share ``L_r`` of the global load-balancing loss (see the module) from
    each layer's router logits (``(tokens, experts)``)."""
    device = gate_logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in gate_logits:
        weights = torch.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        if mask is None:
            counts = counts + torch.bincount(chosen, minlength=experts).float()
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            per_row = mask.repeat_interleave(top_k)
            counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen, per_row)
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    summed = torch.cat([counts, rows.reshape(1)]).detach()
    with group.issuing(AUX_NODE, "all_reduce", summed.numel() * summed.element_size(), False):
        dist.all_reduce(summed, group=group.group)
    total_counts, total_rows = summed[:-1], summed[-1]
    share = (total_counts / total_rows) * (group.replicas * probs / total_rows)
    return share.sum() * experts


__all__ = [
    "AUX_NODE",
    "BalanceGroup",
    "balancing_over",
    "global_balance_loss",
    "use_global_balance_loss",
]
