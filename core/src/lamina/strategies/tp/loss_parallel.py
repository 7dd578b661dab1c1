"""Cross entropy on vocabulary-split logits, without gathering them: :func:`loss_parallel`.

Inside ``with lamina.loss_parallel(model):`` a vocabulary-parallel head returns this
rank's slice of the logits (``1/tp`` of the vocabulary) instead of gathering them, and
``torch.nn.functional.cross_entropy`` on those logits (or a view that keeps the
vocabulary last, as ``logits.reshape(-1, vocab)``) is computed across the group: the
maximum, the sum of exponentials and the target's logit each reduced over the tp group,
the gradient (softmax minus the target's one-hot, on the slice) never leaving the rank.
The loss equals ``cross_entropy`` on the whole logits; ``reduction`` ``"mean"`` /
``"sum"`` / ``"none"`` and ``ignore_index`` are honoured. Any other use of the sliced
logits inside the block is an error naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from lamina.errors import ConfigError
from lamina.strategies.tp.activation_ops import PlannedCollective, TensorGroup, gather

#: Tensor methods that compute nothing from the values (autograd bookkeeping).
_PASS = frozenset({"detach", "requires_grad_", "retain_grad", "register_hook"})
#: Views that keep the vocabulary the last dim of the sliced logits.
_VIEWS = frozenset({"view", "reshape", "flatten", "contiguous", "float", "to"})


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        start: int,
        ignore_index: int,
        tp: TensorGroup,
    ) -> torch.Tensor:
        local = logits.float()
        top = local.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = local - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=tp.group)
        width = local.shape[-1]
        here = (target >= start) & (target < start + width)
        index = (target - start).clamp(0, width - 1)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * here
        dist.all_reduce(picked, group=tp.group)
        loss = total.log() - picked
        valid = target != ignore_index
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, here, valid)
        ctx.dtype = logits.dtype
        return loss.masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, index, here, valid = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index.unsqueeze(-1), -here.unsqueeze(-1).to(softmax.dtype))
        scale = (grad * valid).unsqueeze(-1)
        return (grad_logits * scale).to(ctx.dtype), None, None, None, None


def vocab_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    tp: TensorGroup,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross entropy of ``logits`` (this rank's vocabulary slice from ``start``, last
    dim) against ``target`` (whole-vocabulary ids), reduced over the tp group."""
    flat = logits.reshape(-1, logits.shape[-1])
    ids = target.reshape(-1)
    per_token: torch.Tensor = _VocabCrossEntropy.apply(  # type: ignore[no-untyped-call]
        flat, ids, start, ignore_index, tp
    )
    per_token = per_token.to(logits.dtype)
    if reduction == "none":
        return per_token.reshape(target.shape)
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return per_token.sum() / (ids != ignore_index).sum().clamp(min=1)
    raise ConfigError(f"cross_entropy reduction={reduction!r}: use 'mean', 'sum' or 'none'")


class HeadOutputs:
    """What the vocabulary-parallel heads do with their logits: gather them (``sliced``
    None) or, inside :func:`loss_parallel`, keep the slice and mark it."""

    def __init__(self) -> None:
        self.sliced: _Sliced | None = None

    def finish(
        self, out: torch.Tensor, tp: TensorGroup, gathered: PlannedCollective
    ) -> torch.Tensor:
        """The head's output ``out`` (this rank's vocabulary slice) as the forward gives
        it: gathered (issued as ``gathered``), or the slice inside :func:`loss_parallel`."""
        if self.sliced is None:
            return gather(out, -1, tp, gathered)
        self.sliced.mark(out, out.shape[-1] * tp.index)
        return out


class _Sliced:
    """The sliced logits of this block, by id (the tensors kept alive: no id reuse)."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[torch.Tensor, int]] = {}

    def mark(self, t: torch.Tensor, start: int) -> None:
        self.held[id(t)] = (t, start)

    def start_of(self, t: Any) -> int | None:
        held = self.held.get(id(t)) if isinstance(t, torch.Tensor) else None
        return None if held is None or held[0] is not t else held[1]


class _LossMode(TorchFunctionMode):
    def __init__(self, sliced: _Sliced, tp: TensorGroup) -> None:
        super().__init__()
        self.sliced, self.tp = sliced, tp

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        start = next(
            (s for a in (*args, *kwargs.values()) if (s := self.sliced.start_of(a)) is not None),
            None,
        )
        if start is None or name in ("__get__", "size", "dim", "numel"):
            return func(*args, **kwargs)
        if name == "cross_entropy":
            return _cross_entropy(args, kwargs, start, self.tp)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or name in _PASS:
            return out  # hooks, sizes, flags: nothing computed from the values
        if name in _VIEWS and out.shape[-1] == args[0].shape[-1]:
            self.sliced.mark(out, start)
            return out
        raise ConfigError(
            f"inside lamina.loss_parallel, the vocabulary-split logits go to {name}; only "
            "views that keep the vocabulary last and F.cross_entropy may read them (leave "
            "the block for anything else)"
        )


def _cross_entropy(
    args: tuple[Any, ...], kwargs: dict[str, Any], start: int, tp: TensorGroup
) -> torch.Tensor:
    logits, target = args[0], args[1] if len(args) > 1 else kwargs["target"]
    unsupported = [k for k in ("weight", "label_smoothing") if kwargs.get(k)]
    if unsupported or len(args) > 2:
        raise ConfigError(
            f"lamina.loss_parallel's cross entropy takes ignore_index and reduction, not "
            f"{unsupported or 'positional options'}; pass them by keyword or leave the block"
        )
    return vocab_cross_entropy(
        logits,
        target,
        start,
        tp,
        ignore_index=kwargs.get("ignore_index", -100),
        reduction=kwargs.get("reduction", "mean"),
    )


@contextmanager
def loss_parallel(model: nn.Module) -> Iterator[None]:
    """The block's vocabulary-parallel heads give sliced logits and ``F.cross_entropy``
    on them runs across the tp group (see the module)."""
    state = model.__dict__.get("lamina_tp")
    if state is None or not state.plan.heads:
        raise ConfigError(
            "lamina.loss_parallel needs a model distributed with 'tp' whose head is "
            "vocabulary-parallel (see model.step_summary())"
        )
    sliced = _Sliced()
    state.heads.sliced = sliced
    try:
        with _LossMode(sliced, state.group):
            yield
    finally:
        state.heads.sliced = None


__all__ = ["loss_parallel", "vocab_cross_entropy"]
