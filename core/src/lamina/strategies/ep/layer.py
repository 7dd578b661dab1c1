"""An MoE layer's experts module as expert parallelism runs it: :class:`DispatchedExperts`.

It takes the place of the model's experts module (same attribute, same parameter names,
so ``state_dict`` keys do not change) and holds this rank's experts only
(:class:`~.experts.StackedExperts`). Called as the model calls its experts (the tokens,
each token's top-k expert ids and weights), it hands them to the dispatcher, which moves
every (token, expert) assignment to the rank holding that expert and back
(:mod:`.dispatch`). It counts the assignments it routed, per expert, for the step
summary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lamina.errors import ConfigError
from lamina.strategies.ep.dispatch import Dispatcher, ExpertGroup, Issuing
from lamina.strategies.ep.experts import StackedExperts


class DispatchedExperts(StackedExperts):
    """This rank's experts of MoE layer ``layer``, the others reached by ``dispatcher``
    over ``ep`` (see the module)."""

    def __init__(
        self,
        original: nn.Module,
        ep: ExpertGroup,
        dispatcher: Dispatcher,
        layer: int,
        issuing: Issuing,
    ) -> None:
        gate_up, down = original.gate_up_proj, original.down_proj
        assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
        act: Callable[[torch.Tensor], torch.Tensor] = getattr(original, "act_fn", F.silu)
        super().__init__(gate_up, down, ep.first, ep.local, act)
        self.gate_up_proj.requires_grad_(gate_up.requires_grad)
        self.down_proj.requires_grad_(down.requires_grad)
        self.ep = ep
        self.dispatcher = dispatcher
        self.layer = layer
        self.issuing = issuing
        #: Assignments this rank routed to each of the layer's experts in its last forward.
        self.routed = torch.zeros(ep.experts, dtype=torch.int64)
        #: Called when backward reaches the layer's output (the gradient sync queues).
        self.on_backward: Callable[[], None] | None = None

    def forward(  # type: ignore[override]
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The layer's experts on ``hidden``'s tokens, wherever they are held."""
        self.routed = torch.bincount(
            top_k_index.reshape(-1).detach().cpu(), minlength=self.ep.experts
        )
        out = self.dispatcher.dispatch(
            self.ep,
            hidden,
            top_k_index,
            top_k_weights,
            self.compute,
            self.layer,
            self.issuing,
        )
        reached = self.on_backward
        if reached is not None and out.requires_grad:

            def queued(grad: torch.Tensor) -> torch.Tensor:
                reached()
                return grad

            out.register_hook(queued)  # type: ignore[no-untyped-call]
        return out

    def compute(self, tokens: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """This rank's experts on the tokens grouped by local expert."""
        return StackedExperts.forward(self, tokens, per_expert)


def check_replaceable(name: str, module: nn.Module) -> None:
    """A one-line ConfigError unless ``module``'s experts are the layout
    :class:`DispatchedExperts` computes: ``gate_up_proj`` of ``(experts, 2 x
    intermediate, hidden)``, ``down_proj`` of ``(experts, hidden, intermediate)``, no
    other parameter."""
    weights = ("gate_up_proj", "down_proj")
    extra = sorted(n for n, _ in module.named_parameters() if n not in weights)
    if getattr(module, "is_transposed", False) or extra:
        what = f"parameters {extra}" if extra else "transposed weights"
        raise ConfigError(
            f"strategy 'ep': experts module {name!r} ({type(module).__name__}) has {what}, "
            "which ep does not compute yet; it takes gate_up_proj (experts, 2 x intermediate, "
            "hidden) and down_proj (experts, hidden, intermediate) only: use zero3 for this model"
        )


__all__ = ["DispatchedExperts", "check_replaceable"]
