"""The model's chain of blocks, found from one recorded forward (:func:`find_chain`).

Pipeline stages are cut between blocks: the children of one block container (an
``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``, whatever its keys, or a custom
module holding two or more blocks of one class; see :mod:`lamina.graph.blocks`) that the
forward calls one after another, each block's first argument being the previous block's
output. The blocks keep their own names (``layers.0``, ``layers.blk_a``) and are taken
in call order. What runs before the first block (embeddings, position tables, masks) is
the *prefix*; what runs after the last one (final norm, head) is the *suffix*, including
modules a custom container holds beside its blocks. A model with no such container of
two or more blocks cannot be pipelined, which is a one-line error naming what was looked
for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lamina.errors import ConfigError
from lamina.graph.blocks import chain_of_blocks, record_calls


@dataclass(frozen=True)
class BlockChain:
    """The blocks stages are cut between, and the modules around them."""

    #: Qualified name of the container holding the blocks (``blocks``, ``model.layers``;
    #: ``""`` when the model itself holds them).
    container: str
    #: Qualified names of the blocks in call order (``blocks.0``, ``layers.blk_a``, ...).
    blocks: tuple[str, ...]
    #: Modules with parameters outside the blocks that run before the first block / after
    #: the last.
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    #: Shape and dtype of the activation entering each block (what crosses a cut there).
    entry_shapes: tuple[tuple[int, ...], ...]
    entry_dtype: torch.dtype


def find_chain(model: nn.Module, run: Callable[[], Any]) -> BlockChain:
    """The block container whose blocks the forward (``run``) calls as a chain, holding
    the most parameters (then the longest), see the module: a transformer's layers, not
    the small ``nn.Sequential`` inside each of them."""
    calls = record_calls(model, run)
    found = chain_of_blocks(model, calls)
    if found is None:
        raise ConfigError(
            f"strategy 'pp': {type(model).__name__} has no nn.ModuleList, nn.Sequential, "
            "nn.ModuleDict or other container of two or more blocks that its forward calls "
            "one after another (each taking the previous one's output); put the layers in "
            "such a container to pipeline them"
        )
    container, chain = found
    by_name = {c.name: c for c in calls}
    blocks = tuple(c.name for c in chain)
    first, last = chain[0].order, chain[-1].order
    tops = _top_level(model, blocks)
    prefix = tuple(n for n in tops if n in by_name and by_name[n].order < first)
    suffix = tuple(n for n in tops if n in by_name and by_name[n].order > last)
    shapes = tuple(tuple(c.first_arg.shape) for c in chain if c.first_arg is not None)
    dtype = chain[0].first_arg.dtype if chain[0].first_arg is not None else torch.float32
    return BlockChain(container, blocks, prefix, suffix, shapes, dtype)


def _top_level(model: nn.Module, blocks: tuple[str, ...]) -> list[str]:
    """Modules holding parameters outside the blocks, as high in the tree as they are
    disjoint from them (``tok``, ``model.embed_tokens``, ``lm_head``, a norm a custom
    container holds after its blocks)."""
    names: list[str] = []
    chosen = set(blocks)

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if full in chosen:
                continue
            if any(b.startswith(f"{full}.") for b in blocks):
                visit(full, child)
            elif any(True for _ in child.parameters()):
                names.append(full)

    visit("", model)
    return names


__all__ = ["BlockChain", "find_chain", "record_calls"]
