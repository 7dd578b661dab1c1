"""The model's chain of blocks, found from one recorded forward (:func:`find_chain`).

Pipeline stages are cut between blocks: the entries of one ``nn.ModuleList`` (or
``nn.Sequential``) that the forward calls one after another, each block's first argument
being the previous block's output. What runs before the first block (embeddings,
position tables, masks) is the *prefix*; what runs after the last one (final norm, head)
is the *suffix*. A model with no such list of two or more blocks cannot be pipelined,
which is a one-line error naming what was looked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lamina.errors import ConfigError
from lamina.graph.state import preserved


@dataclass(frozen=True)
class BlockChain:
    """The blocks stages are cut between, and the modules around them."""

    #: Qualified name of the list holding the blocks (``blocks``, ``model.layers``).
    container: str
    #: Qualified names of the blocks in call order (``blocks.0``, ...).
    blocks: tuple[str, ...]
    #: Top-level modules with parameters that run before the first block / after the last.
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    #: Shape and dtype of the activation entering each block (what crosses a cut there).
    entry_shapes: tuple[tuple[int, ...], ...]
    entry_dtype: torch.dtype


@dataclass
class _Call:
    name: str
    first_arg: torch.Tensor | None
    output: torch.Tensor | None = None
    order: int = 0


def record_calls(model: nn.Module, run: Callable[[], Any]) -> list[_Call]:
    """Every module call of one forward (``run``), in the order the calls began."""
    calls: list[_Call] = []
    handles: list[RemovableHandle] = []
    pending: dict[int, list[_Call]] = {}

    def before(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if first is None:
                first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            call = _Call(name, first, order=len(calls))
            calls.append(call)
            pending.setdefault(id(module), []).append(call)

        return hook

    def after(module: nn.Module, _args: Any, out: Any) -> None:
        stack = pending.get(id(module))
        if stack:
            call = stack.pop()
            if isinstance(out, torch.Tensor):
                call.output = out
            elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
                call.output = out[0]

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    try:
        with preserved(model), torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def find_chain(model: nn.Module, run: Callable[[], Any]) -> BlockChain:
    """The list of blocks the forward (``run``) calls as a chain holding the most
    parameters (then the longest), see the module: a transformer's layers, not the
    small ``nn.Sequential`` inside each of them."""
    calls = record_calls(model, run)
    by_name = {c.name: c for c in calls}
    best: tuple[str, list[_Call]] | None = None
    best_score = (0, 0)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = [f"{name}.{i}" if name else str(i) for i in range(len(module))]
        called = [by_name.get(child) for child in children]
        ordered = [c for c in called if c is not None]
        if len(ordered) < len(called):
            continue
        if not _is_chain(ordered):
            continue
        score = (sum(p.numel() for p in module.parameters()), len(ordered))
        if best is None or score > best_score:
            best, best_score = (name, ordered), score
    if best is None:
        raise ConfigError(
            f"strategy 'pp': {type(model).__name__} has no nn.ModuleList or nn.Sequential "
            "of two or more blocks that its forward calls one after another (each taking "
            "the previous one's output); put the layers in such a list to pipeline them"
        )
    container, chain = best
    first, last = chain[0].order, chain[-1].order
    tops = _top_level(model, container)
    prefix = tuple(n for n in tops if n in by_name and by_name[n].order < first)
    suffix = tuple(n for n in tops if n in by_name and by_name[n].order > last)
    shapes = tuple(tuple(c.first_arg.shape) for c in chain if c.first_arg is not None)
    dtype = chain[0].first_arg.dtype if chain[0].first_arg is not None else torch.float32
    return BlockChain(container, tuple(c.name for c in chain), prefix, suffix, shapes, dtype)


def _is_chain(calls: list[_Call]) -> bool:
    """Whether each call began after the previous one and takes its output first."""
    for before, after in itertools.pairwise(calls):
        if after.order <= before.order or before.output is None or after.first_arg is None:
            return False
        if after.first_arg is not before.output and not _same_tensor(
            after.first_arg, before.output
        ):
            return False
    return True


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()


def _top_level(model: nn.Module, container: str) -> list[str]:
    """Modules holding parameters outside the block list, as high in the tree as they
    are disjoint from it (``tok``, ``model.embed_tokens``, ``lm_head``)."""
    names: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if full == container:
                continue
            if container.startswith(f"{full}."):
                visit(full, child)
            elif any(True for _ in child.parameters()):
                names.append(full)

    visit("", model)
    return names
