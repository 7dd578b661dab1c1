"""Where every parameter of a distributed model lives on the mesh: :class:`ModelPlacement`.

Each strategy that holds a model adds what it does on its axes, parameter by parameter,
and declares its role there (:class:`Role`): ``tp`` **splits** a tensor on a dim across
its axis (:class:`Split`), ``zero3`` / ``hsdp`` **shard** the piece they are given in rows
(:class:`Shard`) and replicate it over their replica axes (:class:`Replicate`), ``dp``
replicates, ``pp`` holds each parameter on the **stages** that use it (:class:`Stage`).
So a piece of a parameter on one rank is the same piece on exactly
:meth:`ParameterPlacement.copies` ranks, whatever the composition: the gradient norm,
memory figures and checkpoint layouts are read from one model.

In DTensor's vocabulary, :class:`Split` and :class:`Shard` are both ``Shard(dim)`` (one a
strategy's cut of the whole tensor, the other a sharder's rows of the piece it got),
:class:`Replicate` is ``Replicate()``; a pipeline stage has no DTensor form (other stages
hold other parameters). This module is torch-free data: the placements read the same on
every rank that holds the same parameters, and print as canonical lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from lamina.errors import ConfigError


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the same piece (and, after the step's sync, the same
    gradient)."""

    def describe(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Split:
    """The tensor is cut on ``dim`` across the axis (tensor parallelism: each rank holds
    its slice; for a fused projection, rows block by block, ``parts`` the blocks' whole
    sizes)."""

    dim: int
    parts: tuple[int, ...] = ()

    def describe(self) -> str:
        if len(self.parts) < 2:
            return f"Split({self.dim})"
        return f"Split({self.dim}, {'+'.join(map(str, self.parts))})"


@dataclass(frozen=True)
class Shard:
    """The piece the rank was given is sharded in rows across the axis (ZeRO-3's flat
    shards; 0-dim parameters are replicated instead)."""

    dim: int = 0

    def describe(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Stage:
    """Held by the pipeline ranks ``holders`` of the axis (the stages using it: two for a
    tied embedding and head, else one); other ranks of the axis hold other parameters."""

    holders: tuple[int, ...]

    def describe(self) -> str:
        return f"Stage({', '.join(map(str, self.holders))})"


AxisPlacement = Replicate | Split | Shard | Stage


@dataclass(frozen=True)
class ParameterPlacement:
    """One parameter's placement: per mesh axis, what the strategy holding that axis does."""

    name: str
    axes: tuple[tuple[str, AxisPlacement], ...] = ()

    def on(self, axis: str) -> AxisPlacement | None:
        """Its placement on ``axis`` (None: no strategy placed it there)."""
        return next((p for a, p in self.axes if a == axis), None)

    def copies(self, sizes: Mapping[str, int]) -> int:
        """Ranks holding the same piece of it as this rank (this rank included): every
        rank of an axis it is replicated over, every pipeline rank that holds it."""
        count = 1
        for axis, where in self.axes:
            if isinstance(where, Replicate):
                count *= sizes[axis]
            elif isinstance(where, Stage):
                count *= len(where.holders)
        return count

    def describe(self) -> str:
        """``tp: Split(0), fsdp: Shard(0)``."""
        return ", ".join(f"{a}: {p.describe()}" for a, p in self.axes) or "whole"


#: What a strategy does on its axes; the order of composition follows from them.
ROLES = ("split", "pipeline", "shard", "replicate")


@dataclass(frozen=True)
class Role:
    """A strategy's declared role on its axes: ``split`` (cut layers: tp), ``pipeline``
    (stages: pp), ``shard`` (parameters sharded: zero3, hsdp's shard axes) or
    ``replicate`` (whole copies kept in sync: dp, hsdp's replica axes, pp's replicas)."""

    strategy: str
    role: str
    axes: tuple[str, ...]
    #: Whether batches differ across these axes (data parallel, sharded or replicated);
    #: a split or a pipeline sees the same batch on each of its ranks.
    data: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(
                f"strategy {self.strategy!r} declares role {self.role!r}; declare one of {ROLES}"
            )

    def describe(self) -> str:
        return f"{self.strategy}: {self.role} over {list(self.axes)}"


@dataclass(frozen=True)
class ModelPlacement:
    """Every parameter's placement on the mesh, and the roles that placed them."""

    #: The mesh's axes and their sizes, in mesh order.
    mesh: tuple[tuple[str, int], ...]
    roles: tuple[Role, ...] = ()
    params: Mapping[str, ParameterPlacement] = field(default_factory=dict)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes over which batches differ (in mesh order): a loop gives each data
        replica its own share of the data."""
        data = {a for r in self.roles if r.data for a in r.axes}
        # a sharder spanning a split's axis (cp's) shards there, but the split's ranks
        # see one batch between them; a split that moves tokens to the pieces it cut
        # (ep's experts) sees a batch on each rank
        data -= {
            a for r in self.roles if r.role in ("split", "pipeline") and not r.data for a in r.axes
        }
        return tuple(a for a, _ in self.mesh if a in data)

    def of(self, name: str) -> ParameterPlacement:
        """Parameter ``name``'s placement (replicated on every axis when no strategy
        placed it: a parameter the model holds outside any strategy's reach)."""
        found = self.params.get(name)
        return found if found is not None else ParameterPlacement(name)

    def copies(self, name: str) -> int:
        """Ranks holding the same piece of parameter ``name`` as this rank."""
        return self.of(name).copies(self.sizes)

    def spans_pieces(self) -> bool:
        """Whether ranks hold different pieces of the model (some role splits, shards or
        pipelines): the same answer on every rank, so a norm across ranks is collective
        exactly when this is true."""
        return any(r.role != "replicate" for r in self.roles)

    def placed(
        self,
        role: Role,
        per_param: Mapping[str, Mapping[str, AxisPlacement]],
        default: AxisPlacement | None = None,
        names: Iterable[str] = (),
    ) -> ModelPlacement:
        """This placement with ``role`` added: each parameter of ``per_param`` placed on
        ``role``'s axes as given, each other one of ``names`` placed ``default`` on every
        axis of the role. An axis another role already placed is a ConfigError naming
        both (two strategies on one axis must declare roles that share it)."""
        taken = {a: r for r in self.roles for a in r.axes}
        for axis in role.axes:
            if axis not in self.sizes:
                raise ConfigError(
                    f"strategy {role.strategy!r} places axis {axis!r}, which the mesh "
                    f"{[a for a, _ in self.mesh]} lacks; name an axis of lamina.init(mesh=...)"
                )
            earlier = taken.get(axis)
            if earlier is not None and not self._shares(earlier, role, axis):
                raise ConfigError(
                    f"strategies {earlier.strategy!r} ({earlier.role}) and {role.strategy!r} "
                    f"({role.role}) both take mesh axis {axis!r}; give each its own axis"
                )
        params = dict(self.params)
        wanted = {**{n: {} for n in names}, **per_param}
        for name, given in wanted.items():
            current = params.get(name, ParameterPlacement(name))
            added = []
            for axis in role.axes:
                where = given.get(axis, default)
                if where is None:
                    raise ConfigError(
                        f"strategy {role.strategy!r} did not place parameter {name!r} on "
                        f"axis {axis!r}; place every parameter it holds"
                    )
                added.append((axis, where))
            order = [a for a, _ in self.mesh]
            merged = {**dict(current.axes), **dict(added)}
            axes = tuple(sorted(merged.items(), key=lambda item: order.index(item[0])))
            params[name] = replace(current, axes=axes)
        return replace(self, roles=(*self.roles, role), params=params)

    def _shares(self, earlier: Role, later: Role, axis: str) -> bool:
        """Whether ``later`` may take ``axis`` too: a sharder may shard over an axis whose
        earlier role splits activations only (every parameter replicated there, as
        context parallelism leaves them, so FSDP2-style sharding spans it too)."""
        if later.role != "shard" or earlier.role != "split":
            return False
        return all(
            isinstance(p.on(axis), Replicate)
            for p in self.params.values()
            if p.on(axis) is not None
        )

    def lines(self) -> tuple[str, ...]:
        """Canonical lines: the roles, then each parameter's placement by name."""
        return (
            *(f"role {r.describe()}" for r in self.roles),
            *(f"{n}: {self.params[n].describe()}" for n in sorted(self.params)),
        )

    def replica(self, coordinates: Mapping[str, int]) -> tuple[int, int]:
        """This rank's data replica from its mesh ``coordinates``: (index, count) over the
        data axes in mesh order."""
        index, count = 0, 1
        for axis in self.data_axes:
            size = self.sizes[axis]
            index, count = index * size + coordinates[axis], count * size
        return index, count


__all__ = [
    "ROLES",
    "AxisPlacement",
    "ModelPlacement",
    "ParameterPlacement",
    "Replicate",
    "Role",
    "Shard",
    "Split",
    "Stage",
]
