"""What one rank is about to run, as canonical text lines grouped by category.

Every builder here is a pure function of its input whose text is the same in every
process, whatever ``PYTHONHASHSEED`` is or which device index the rank uses: no node
names, no devices, no memory addresses, no set or dict iteration of unordered data.
Ranks compare the per-category sha256 digests first and only exchange the lines when a
digest differs, to say where.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from lamina.dtypes import dtype_name
from lamina.errors import ConfigError

if TYPE_CHECKING:
    from lamina.graph.metadata import CapturedGraph
    from lamina.memory.layout import ShardLayout

CATEGORIES = ("world", "backend", "mesh", "parameters", "graph", "shards", "plan")
"""Every category, in the order ranks compare them (and messages report them)."""

DIGEST_SIZE = 32
"""Bytes of one category's digest (sha256)."""

Items = tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Manifest:
    """One rank's canonical lines per category (categories in :data:`CATEGORIES` order)."""

    rank: int
    items: Items

    def __post_init__(self) -> None:
        by_name = dict(self.items)
        unknown = [name for name, _ in self.items if name not in CATEGORIES]
        if unknown or len(by_name) != len(self.items):
            raise ConfigError(
                f"manifest categories must be distinct names from {list(CATEGORIES)}, got "
                f"{[name for name, _ in self.items]}"
            )
        for name, lines in self.items:
            if not all(isinstance(line, str) for line in lines):
                raise ConfigError(f"manifest category {name!r} must hold strings only")
        ordered = tuple((c, tuple(by_name[c])) for c in CATEGORIES if c in by_name)
        object.__setattr__(self, "items", ordered)

    @property
    def categories(self) -> tuple[str, ...]:
        """The categories this manifest holds, in comparison order."""
        return tuple(name for name, _ in self.items)

    def has(self, category: str) -> bool:
        """Whether the manifest holds ``category`` (even with no lines)."""
        return any(name == category for name, _ in self.items)

    def lines(self, category: str) -> tuple[str, ...]:
        """The lines of ``category``; empty when the manifest does not hold it."""
        for name, lines in self.items:
            if name == category:
                return lines
        return ()

    def digests(self) -> dict[str, str]:
        """sha256 hex digest of ``"\\n".join(lines)`` per held category."""
        return {name: _digest(lines).hex() for name, lines in self.items}

    def digest_bytes(self) -> bytes:
        """Every category's raw digest in :data:`CATEGORIES` order (zeros where absent)."""
        held = dict(self.items)
        return b"".join(_digest(held[c]) if c in held else bytes(DIGEST_SIZE) for c in CATEGORIES)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (picklable, JSON-serializable); :meth:`from_dict` reads it back."""
        return {"rank": self.rank, "items": [[name, list(lines)] for name, lines in self.items]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """The manifest :meth:`to_dict` described."""
        try:
            items = tuple((str(name), tuple(lines)) for name, lines in data["items"])
            return cls(int(data["rank"]), items)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed manifest data ({exc!r}); rebuild it") from None


def _digest(lines: Sequence[str]) -> bytes:
    return hashlib.sha256("\n".join(lines).encode("utf-8")).digest()


def world_lines(world_size: int) -> tuple[str, ...]:
    """The number of ranks the job was launched with."""
    return (f"world_size={world_size}",)


def backend_lines(backend_name: str, collective_backend: str) -> tuple[str, ...]:
    """The lamina backend and the torch.distributed backend it runs collectives with."""
    return (f"backend={backend_name}", f"collective_backend={collective_backend}")


def mesh_lines(shape: Sequence[int], names: Sequence[str]) -> tuple[str, ...]:
    """The device mesh's shape and dimension names."""
    return (f"shape={[int(s) for s in shape]}", f"names={[str(n) for n in names]}")


def parameter_lines(module: nn.Module) -> tuple[str, ...]:
    """One line per parameter in ``named_parameters()`` order (tied ones once):
    ``"<name>: <shape> <dtype> requires_grad=<bool>"``."""
    return tuple(
        f"{name}: {list(p.shape)} {dtype_name(p.dtype)} requires_grad={p.requires_grad}"
        for name, p in module.named_parameters()
    )


def graph_lines(graph: CapturedGraph) -> tuple[str, ...]:
    """The capture method, then one line per node: op, target, output shapes and dtypes
    (what the graph fingerprint hashes; node names and devices are left out)."""
    nodes = (
        f"#{i} {n.op} {n.target}: shapes={[list(s) for s in n.shapes]} dtypes={list(n.dtypes)}"
        for i, n in enumerate(graph.nodes)
    )
    return (f"captured by {graph.method}", *nodes)


def shard_lines(layout: ShardLayout) -> tuple[str, ...]:
    """One line per unit of the shard layout: sizes, padding, parameters with offsets."""
    return tuple(
        f"unit {u.index} {u.name}: {u.dtype} world_size={u.world_size} "
        f"align={u.alignment_bytes} total_numel={u.total_numel} shard_numel={u.shard_numel} "
        f"padding={u.padding} params=[{', '.join(f'{p.name}@{p.offset}' for p in u.params)}]"
        for u in layout.units
    )


def build_manifest(
    rank: int,
    *,
    world_size: int,
    backend: str,
    collective_backend: str,
    mesh_shape: Sequence[int],
    mesh_names: Sequence[str],
    module: nn.Module | None = None,
    graph: CapturedGraph | None = None,
    layout: ShardLayout | None = None,
    plan_lines: Iterable[str] | None = None,
) -> Manifest:
    """This rank's manifest: world, backend and mesh always, the rest when given.

    ``plan_lines`` is the plan's canonical text, e.g. ``plan.collective_sequence()``.
    """
    items: list[tuple[str, tuple[str, ...]]] = [
        ("world", world_lines(world_size)),
        ("backend", backend_lines(backend, collective_backend)),
        ("mesh", mesh_lines(mesh_shape, mesh_names)),
    ]
    if module is not None:
        items.append(("parameters", parameter_lines(module)))
    if graph is not None:
        items.append(("graph", graph_lines(graph)))
    if layout is not None:
        items.append(("shards", shard_lines(layout)))
    if plan_lines is not None:
        items.append(("plan", tuple(str(line) for line in plan_lines)))
    return Manifest(rank, tuple(items))
