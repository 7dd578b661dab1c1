"""What context parallelism learns from the model before its first collective:
:func:`probe_forward`.

The forward runs twice in this process, without gradients, on the example inputs cut to
this rank's length and to half of it. Every ``arange`` and leading slice whose
length follows the sequence in both runs builds positions (``torch.arange(seq)``, a
rotary table cut as ``table[:seq]``): at run time it is given the global positions of
this rank's tokens instead. Every attention call is read (heads, key/value heads, mask,
dropout): a kind context parallelism cannot split is a one-line error here, before any
collective. So are a forward whose calls change with the sequence's length and one
without attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lamina.errors import ConfigError
from lamina.strategies.cp.calls import SDPA, Ranged, attention_call, ranged
from lamina.strategies.cp.plan_nodes import AttentionSite, OutputSite, dtype_of


class _Recording(TorchFunctionMode):
    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.ranges: list[Ranged] = []
        self.sites: list[AttentionSite] = []
        self.problems: list[str] = []
        self.names = names
        #: The modules running now (innermost last), each with its attention calls so far.
        self.stack: list[list[Any]] = []

    @contextmanager
    def modules_tracked(self) -> Iterator[None]:
        """Keep :attr:`stack` while the forward runs (global module hooks, removed after)."""

        def enter(module: nn.Module, _args: Any) -> None:
            self.stack.append([self.names.get(id(module), ""), 0])

        def leave(module: nn.Module, _args: Any, _out: Any) -> None:
            if self.stack:
                self.stack.pop()

        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(enter),
            torch.nn.modules.module.register_module_forward_hook(leave, always_call=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        found = ranged(func, args, kwargs)
        if found is not None:
            self.ranges.append(found)
        if func is SDPA:
            self._attention(args, kwargs)
        return func(*args, **kwargs)

    def _attention(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call = attention_call(args, kwargs)
        q, k, v = call.query, call.key, call.value
        index = len(self.sites)
        if call.attn_mask is not None:
            self.problems.append(
                f"attention call {index} passes attn_mask: context parallelism splits causal "
                "or unmasked attention; give packed documents as document_ids= (or position "
                "ids restarting per document) instead of a mask"
            )
        if call.dropout_p > 0:
            self.problems.append(
                f"attention call {index} uses dropout_p={call.dropout_p}: context-parallel "
                "attention runs without attention dropout; set it to 0"
            )
        if q.dim() != 4 or k.shape[-2] != q.shape[-2]:
            self.problems.append(
                f"attention call {index} is not self-attention over the sequence (query "
                f"{tuple(q.shape)}, key {tuple(k.shape)}); context parallelism splits "
                "self-attention in (batch, heads, tokens, head dim) form"
            )
            return
        module, call_in_module = "", 0
        if self.stack:
            module, call_in_module = self.stack[-1]
            self.stack[-1][1] += 1
        self.sites.append(
            AttentionSite(
                index=index,
                batch=q.shape[0],
                heads=q.shape[1],
                kv_heads=k.shape[1],
                head_dim=q.shape[-1],
                value_dim=v.shape[-1],
                dtype=dtype_of(q),
                causal=call.is_causal,
                module=module,
                call=call_in_module,
            )
        )


@dataclass(frozen=True)
class Probed:
    """The attention sites, the positional calls (ordinals among the calls of this
    rank's length, per kind), and the outputs cut on the sequence."""

    sites: tuple[AttentionSite, ...]
    positional: frozenset[tuple[str, int]]
    outputs: tuple[OutputSite, ...]


def cut_inputs(
    value: Any, length: int, dim: int, keep: Callable[[torch.Tensor], torch.Tensor]
) -> Any:
    """``value`` (args or kwargs) with every tensor whose ``dim`` is ``length`` long
    replaced by ``keep(tensor)``."""

    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == length:
            return keep(t)
        return t

    return pytree.tree_map(cut, value)


def probe_forward(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    length: int,
    local: int,
    dim: int,
    extra: Callable[[int], dict[str, Any]],
) -> Probed:
    """Run the forward on the inputs cut to ``local`` and ``local / 2`` tokens (``extra``
    adds keyword arguments for a length) and read it (see the module)."""
    runs = []
    outputs: tuple[OutputSite, ...] = ()
    # half the length keeps every divisibility a composed strategy needs (tp's sequence
    # parallelism cuts the sequence again); a length of 1 cannot tell positions apart
    other = local // 2 if local % 2 == 0 and local >= 4 else local - 1
    for size in (local, other):

        def keep(t: torch.Tensor, n: int = size) -> torch.Tensor:
            return t.narrow(dim, 0, n)

        cut_args = cut_inputs(args, length, dim, keep)
        cut_kwargs = cut_inputs(kwargs, length, dim, keep)
        recording = _Recording({id(m): n for n, m in model.named_modules()})
        with torch.no_grad(), recording.modules_tracked(), recording:
            out = model(*cut_args, **{**cut_kwargs, **extra(size)})
        runs.append(recording)
        if size == local:
            outputs = tuple(
                OutputSite((*t.shape[:dim], length, *t.shape[dim + 1 :]), dtype_of(t))
                for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == local
            )
    first, second = runs
    if first.problems:
        raise ConfigError(f"strategy 'cp': {first.problems[0]}")
    if not first.sites:
        raise ConfigError(
            "strategy 'cp' found no scaled_dot_product_attention call in the model's forward; "
            "context parallelism replaces the model's attention: call "
            "torch.nn.functional.scaled_dot_product_attention (or a transformers attention "
            "interface built on it)"
        )
    if [r.kind for r in first.ranges] != [r.kind for r in second.ranges] or len(first.sites) != len(
        second.sites
    ):
        raise ConfigError(
            "strategy 'cp': the model's forward makes different calls at different sequence "
            "lengths; context parallelism needs a forward whose calls do not depend on the "
            "length (a static graph)"
        )
    positional: set[tuple[str, int]] = set()
    ordinal: dict[str, int] = {}
    for a, b in zip(first.ranges, second.ranges, strict=True):
        if a.length != local:
            continue
        k = ordinal.get(a.kind, 0)
        ordinal[a.kind] = k + 1
        if b.length == other:
            positional.add((a.kind, k))
    if not outputs:
        raise ConfigError(
            "strategy 'cp': no output of the model's forward has the sequence on dim "
            f"{dim}; context parallelism gathers the outputs cut on the sequence (logits)"
        )
    return Probed(tuple(first.sites), frozenset(positional), outputs)
