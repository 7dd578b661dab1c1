"""What one rank is about to run, as canonical text lines grouped by category.

Every builder here is a pure function of its input whose text is the same in every
process, whatever ``PYTHONHASHSEED`` is or which device index the rank uses: no node
names, no devices, no memory addresses, no set or dict iteration of unordered data.
Ranks compare one sha256 digest of the whole manifest first and only exchange the lines
when it differs, to say where. The core categories are :data:`CATEGORIES`; a strategy
adds its own (e.g. ``graph``, ``shards``) between ``parameters`` and ``plan``, so this
module knows nothing of graphs or shard layouts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lamina.dtypes import dtype_name
from lamina.errors import ConfigError

CATEGORIES = ("world", "backend", "mesh", "parameters", "plan")
"""The core categories, in the order ranks compare them; a strategy's own come before
``plan``."""

DIGEST_SIZE = 32
"""Bytes of a digest (sha256)."""

Items = tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Manifest:
    """One rank's canonical lines per category (categories in :data:`CATEGORIES` order)."""

    rank: int
    items: Items

    def __post_init__(self) -> None:
        names = [name for name, _ in self.items]
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"manifest categories must be distinct non-empty names, got {names}")
        for name, lines in self.items:
            if not all(isinstance(line, str) for line in lines):
                raise ConfigError(f"manifest category {name!r} must hold strings only")
        object.__setattr__(self, "items", tuple((n, tuple(lines)) for n, lines in self.items))

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
        """One sha256 over every category's name and digest, in order: equal manifests
        give equal bytes (:data:`DIGEST_SIZE` of them)."""
        whole = hashlib.sha256()
        for name, lines in self.items:
            whole.update(name.encode("utf-8") + b"\0" + _digest(lines))
        return whole.digest()

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
    """A device mesh's shape and axis names (``DeviceMesh.lines()`` adds the rank grid)."""
    return (f"shape={[int(s) for s in shape]}", f"names={[str(n) for n in names]}")


def parameter_lines(module: nn.Module) -> tuple[str, ...]:
    """One line per parameter in ``named_parameters()`` order (tied ones once):
    ``"<name>: <shape> <dtype> requires_grad=<bool>"``."""
    return tuple(
        f"{name}: {list(p.shape)} {dtype_name(p.dtype)} requires_grad={p.requires_grad}"
        for name, p in module.named_parameters()
    )


def build_manifest(
    rank: int,
    *,
    world_size: int,
    backend: str,
    collective_backend: str,
    mesh: Sequence[str],
    module: nn.Module | None = None,
    extra: Iterable[tuple[str, Sequence[str]]] = (),
    plan_lines: Iterable[str] | None = None,
    leading: Iterable[tuple[str, Sequence[str]]] = (),
) -> Manifest:
    """This rank's manifest: world, backend and mesh (its canonical ``lines``) always,
    then the ``leading`` categories, the parameters, the ``extra`` categories a strategy
    contributes, and the plan.

    ``plan_lines`` is the plan's canonical text, e.g. ``plan.collective_sequence()``.
    """
    items: list[tuple[str, tuple[str, ...]]] = [
        ("world", world_lines(world_size)),
        ("backend", backend_lines(backend, collective_backend)),
        ("mesh", tuple(str(line) for line in mesh)),
    ]
    items += [(name, tuple(str(line) for line in lines)) for name, lines in leading]
    if module is not None:
        items.append(("parameters", parameter_lines(module)))
    items += [(name, tuple(str(line) for line in lines)) for name, lines in extra]
    if plan_lines is not None:
        items.append(("plan", tuple(str(line) for line in plan_lines)))
    return Manifest(rank, tuple(items))
