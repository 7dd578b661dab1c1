"""The model's blocks: the repeated modules its forward runs one after another.

A *block container* holds the model's blocks as its children:

- an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``: every child is a block,
  whatever its name (``layers.0``, ``layers.blk_a``);
- any other module with two or more children of one class that have submodules of their
  own (a custom container of transformer blocks): those children are its blocks (of the
  class most of its children share). Single layers (modules without submodules: two
  embeddings, an attention's q/k/v/o ``nn.Linear`` projections) are not blocks.

Blocks are named by their real qualified names. :func:`block_containers` lists the
containers, :func:`container_blocks` one container's blocks, :func:`block_holding` the
outermost block around a module (tensor parallelism's block), :func:`unit_blocks` the
blocks of the first container (ZeRO-3's units). Which container is the model's *chain*
needs a forward: :func:`record_calls` records one, and :func:`chain_of_blocks` picks the
container whose blocks that forward calls one after another, each taking the previous
one's output (pipeline parallelism's cut, ``auto``'s measurements).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lamina.graph.state import preserved

#: Containers whose every child is a block.
STANDARD_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
#: Attribute of a module standing in for a block (a pipeline stage's skipped block): the
#: class of the block it replaces, so that its container is still found.
STANDS_IN_FOR = "lamina_stands_in_for"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in module._modules.items() if m is not None]


def _local_blocks(module: nn.Module) -> tuple[str, ...]:
    """Names (local to ``module``) of its children that are blocks; none if it is not a
    block container (see the module)."""
    children = _children(module)
    if isinstance(module, STANDARD_CONTAINERS):
        return tuple(n for n, _ in children)
    by_class: dict[type[nn.Module], list[str]] = {}
    for name, child in children:
        kind = getattr(child, STANDS_IN_FOR, None)
        if kind is None and any(True for _ in child.children()):  # a block, not a layer
            kind = type(child)
        if kind is not None:
            by_class.setdefault(kind, []).append(name)
    largest = max(by_class.values(), key=len, default=[])  # ties: the first class seen
    return tuple(largest) if len(largest) >= 2 else ()


def block_containers(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of ``model``'s block containers (``""`` for the model itself), in
    ``named_modules()`` order: outer containers before the ones inside their blocks."""
    return tuple(name for name, module in model.named_modules() if _local_blocks(module))


def container_blocks(model: nn.Module, container: str) -> tuple[str, ...]:
    """Qualified names of the blocks of ``container`` (a name from
    :func:`block_containers`), in registration order; none if it holds no blocks."""
    module = model.get_submodule(container)
    return tuple(_join(container, n) for n in _local_blocks(module))


def block_holding(model: nn.Module, name: str) -> str:
    """The block holding module ``name`` (the outermost one: ``blocks.0`` for
    ``blocks.0.mlp.0``, though the ``mlp`` is a container too), or ``name`` itself when no
    block holds it (an embedding, the head)."""
    parts = name.split(".") if name else []
    parent: nn.Module | None = model
    for depth, part in enumerate(parts, start=1):
        if parent is None:
            break
        if part in _local_blocks(parent):
            return ".".join(parts[:depth])
        parent = parent._modules.get(part)
    return name


def unit_blocks(model: nn.Module) -> tuple[str, ...]:
    """The blocks holding parameters of the first block container (in ``named_modules()``
    order, the model itself included) that has such blocks: ZeRO-3's default units. None
    if no container has."""
    for name, module in model.named_modules():
        held = tuple(
            _join(name, n)
            for n in _local_blocks(module)
            if any(True for _ in module._modules[n].parameters())  # type: ignore[union-attr]
        )
        if held:
            return held
    return ()


@dataclass
class ModuleCall:
    """One module call of a recorded forward."""

    #: Qualified name of the module called.
    name: str
    #: Its first tensor argument (positional, else keyword); None if it took no tensor.
    first_arg: torch.Tensor | None
    #: Its output (a tuple's or list's first tensor); None if it returned no tensor.
    output: torch.Tensor | None = None
    #: Position among the forward's calls, in the order they began.
    order: int = 0


def record_calls(model: nn.Module, run: Callable[[], Any]) -> list[ModuleCall]:
    """Every module call of one forward (``run``, without gradients, the model's state
    preserved), in the order the calls began."""
    calls: list[ModuleCall] = []
    handles: list[RemovableHandle] = []
    pending: dict[int, list[ModuleCall]] = {}

    def before(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if first is None:
                first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            call = ModuleCall(name, first, order=len(calls))
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


def is_chain(calls: Sequence[ModuleCall]) -> bool:
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


def chain_of_blocks(
    model: nn.Module, calls: Sequence[ModuleCall]
) -> tuple[str, tuple[ModuleCall, ...]] | None:
    """The block container whose two or more blocks the forward (``calls``, from
    :func:`record_calls`) all calls as a chain (:func:`is_chain`), and those blocks' calls
    in call order: of several, the one whose blocks hold the most parameters, then the
    longest (a transformer's layers, not the small ``nn.Sequential`` inside each of
    them). None if there is none."""
    by_name = {c.name: c for c in calls}
    best: tuple[str, tuple[ModuleCall, ...]] | None = None
    best_score = (0, 0)
    for container in block_containers(model):
        blocks = container_blocks(model, container)
        called = [by_name.get(b) for b in blocks]
        ordered = sorted((c for c in called if c is not None), key=lambda c: c.order)
        if len(blocks) < 2 or len(ordered) < len(called) or not is_chain(ordered):
            continue
        params = {id(p): p.numel() for b in blocks for p in model.get_submodule(b).parameters()}
        score = (sum(params.values()), len(ordered))
        if best is None or score > best_score:
            best, best_score = (container, tuple(ordered)), score
    return best


__all__ = [
    "STANDARD_CONTAINERS",
    "STANDS_IN_FOR",
    "ModuleCall",
    "block_containers",
    "block_holding",
    "chain_of_blocks",
    "container_blocks",
    "is_chain",
    "record_calls",
    "unit_blocks",
]
