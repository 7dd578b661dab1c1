"""This rank's step on its own tokens, as cp measures it before planning:
:func:`local_step`.

The forward + backward of the model on the tokens this rank holds, with the model's own
attention over them, and with the step's synchronisation: at each attention call a
one-element all-reduce over the cp group forward and again backward (where the real
step exchanges keys and values), one after the forward (the outputs' gather) and one
after backward (the gradient sync). Timed with every rank at once, it is the compute a
rank gets of a shared device plus what each exchange waits for the last rank, as in
the step, without the exchanges' bytes (the simulator prices those on the cluster).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lamina.strategies.cp.calls import SDPA
from lamina.strategies.cp.layout import SequenceLayout
from lamina.strategies.cp.probe import cut_inputs


class _Sync(torch.autograd.Function):
    """Identity on ``x`` with a one-element all-reduce forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wait: Callable[[], None]) -> torch.Tensor:
        ctx.wait = wait
        wait()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.wait()
        return grad, None


class _SyncedAttention(TorchFunctionMode):
    def __init__(self, wait: Callable[[], None]) -> None:
        super().__init__()
        self.wait = wait

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is SDPA and args:
            args = (_Sync.apply(args[0], self.wait), *args[1:])  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)


def local_step(
    model: nn.Module,
    layout: SequenceLayout,
    args: Any,
    kwargs: Any,
    dim: int,
    extra: dict[str, Any],
    group: dist.ProcessGroup | None,
) -> Callable[[], None]:
    """The step of the module's docstring as a callable (gradients left as they were);
    ``extra``: keyword arguments for this rank's positions; ``group``: the cp group
    (None: no synchronisation, one process)."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        return layout.shard(t, dim)

    cut_args = cut_inputs(tuple(args), layout.length, dim, keep)
    cut_kwargs = {**cut_inputs(dict(kwargs), layout.length, dim, keep), **extra}
    params = [p for p in model.parameters() if p.requires_grad]
    device = next((p.device for p in params), torch.device("cpu"))
    one = torch.zeros(1, device=device)

    def wait() -> None:
        if group is not None:
            dist.all_reduce(one, group=group)

    def whole() -> None:
        if group is not None:
            dist.all_reduce(one)

    def run() -> None:
        kept = [p.grad for p in params]
        with _SyncedAttention(wait):
            out = model(*cut_args, **cut_kwargs)
        wait()
        leaves = [
            t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if leaves:
            torch.stack([t.float().sum() for t in leaves]).sum().backward()  # type: ignore[no-untyped-call]
        whole()
        for p, g in zip(params, kept, strict=True):
            p.grad = g

    return run


__all__ = ["local_step"]
