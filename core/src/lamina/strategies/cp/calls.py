"""The calls of a forward that context parallelism reads or replaces, recognised from
``torch`` function calls (a :class:`~torch.overrides.TorchFunctionMode` sees each one):
``torch.arange`` and leading slices ``t[:n]`` (the model's position ids and rotary or
position tables cut to the sequence), and ``scaled_dot_product_attention``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ARANGE, SLICE = "arange", "slice"
SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(frozen=True)
class Ranged:
    """An ``arange`` or a leading slice: its kind, the dim it cuts (slices), the start
    and the length it produces."""

    kind: str
    dim: int
    start: int
    length: int


def ranged(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Ranged | None:
    """The :class:`Ranged` a call makes (None: it makes none)."""
    if func is torch.arange:
        numbers = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        if len(numbers) != len(args) or not numbers or kwargs.get("step", 1) != 1:
            return None
        if "end" in kwargs or "start" in kwargs:
            return None
        start, end = (0, numbers[0]) if len(numbers) == 1 else (numbers[0], numbers[1])
        if len(numbers) == 3 and numbers[2] != 1:
            return None
        return Ranged(ARANGE, 0, start, end - start)
    if func is torch.Tensor.__getitem__ and len(args) == 2:
        index = args[1]
        parts = index if isinstance(index, tuple) else (index,)
        for dim, part in enumerate(parts):
            if not isinstance(part, slice):
                return None
            if part == slice(None):
                continue
            if part.step not in (None, 1) or not isinstance(part.stop, int):
                return None
            start = part.start or 0
            if not isinstance(start, int) or start < 0 or part.stop < 0:
                return None
            if any(p != slice(None) for p in parts[dim + 1 :]):
                return None
            return Ranged(SLICE, dim, start, part.stop - start)
    return None


@dataclass(frozen=True)
class AttentionCall:
    """The arguments of one ``scaled_dot_product_attention`` call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool


def attention_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> AttentionCall:
    """``scaled_dot_product_attention``'s arguments by name, defaults filled."""
    given = dict(zip(_SDPA_ARGS, args, strict=False))
    given.update(kwargs)
    return AttentionCall(
        given["query"],
        given["key"],
        given["value"],
        given.get("attn_mask"),
        float(given.get("dropout_p", 0.0)),
        bool(given.get("is_causal", False)),
        given.get("scale"),
        bool(given.get("enable_gqa", False)),
    )
