"""The model's trainable parameters: canonical names, aliases (tied weights), lookups.

A capture path reports parameter uses by whatever handle it sees (an FQN from
``torch.export``, a ``get_attr`` target, a tensor object); this table turns each into the
canonical name, so that every path agrees on naming.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from lamina.graph.metadata import Shape


@dataclass(frozen=True)
class ParamTable:
    """Canonical names of a model's trainable parameters and every alias of each."""

    names: tuple[str, ...]
    shapes: dict[str, Shape]
    dtypes: dict[str, str]
    tied: tuple[tuple[str, ...], ...]
    by_fqn: dict[str, str]
    by_id: dict[int, str]

    @classmethod
    def of(cls, model: nn.Module) -> ParamTable:
        """Read ``model``'s parameters; frozen ones (``requires_grad=False``) are left out."""
        aliases: dict[int, list[str]] = {}
        for fqn, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(fqn)
        names: list[str] = []
        groups: list[tuple[str, ...]] = []
        shapes: dict[str, Shape] = {}
        dtypes: dict[str, str] = {}
        by_fqn: dict[str, str] = {}
        by_id: dict[int, str] = {}
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            group = (name, *(a for a in aliases[id(param)] if a != name))
            names.append(name)
            shapes[name] = tuple(param.shape)
            dtypes[name] = str(param.dtype)
            by_id[id(param)] = name
            by_fqn.update(dict.fromkeys(group, name))
            if len(group) > 1:
                groups.append(group)
        return cls(tuple(names), shapes, dtypes, tuple(groups), by_fqn, by_id)

    def order(self, first_use: dict[str, int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(first_use_order, unused)`` from each used parameter's first-use position.

        Parameters first used at the same position (one op taking weight and bias) keep
        their registration order.
        """
        rank = {n: i for i, n in enumerate(self.names)}
        used = sorted(first_use, key=lambda n: (first_use[n], rank[n]))
        unused = tuple(n for n in self.names if n not in first_use)
        return tuple(used), unused

    def mark(self, first_use: dict[str, int], names: Iterable[str | None], position: int) -> None:
        """Record a use at ``position`` of each named parameter (``None``: not trainable)."""
        for name in names:
            if name is not None and position < first_use.get(name, position + 1):
                first_use[name] = position
