"""DeviceMesh v2: torch's DeviceMesh with up to four named axes, shaped by the topology.

Vocabulary: a mesh *axis* is one dimension of the rank grid (``"inter"``, ``"intra"``,
``"dp"``, ``"fsdp"``, ``"tp"``); tensor dimensions are called *dims* elsewhere. Ranks are
laid out in order with the last axis innermost, so the innermost axis should group ranks
joined by fast links (:func:`tp_axis_warning` says when a ``"tp"`` axis does not). A
process group spans one axis, all axes, or any other subset (:meth:`DeviceMesh.group_over`,
a flattened torch sub-mesh).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh

from lamina.device.topology import Topology
from lamina.errors import MeshError

#: Axis names used when a mesh is factorized from a topology.
TOPOLOGY_AXES: tuple[str, str] = ("inter", "intra")

#: Most axes a mesh may have.
MAX_MESH_AXES = 4

#: The axis :func:`tp_axis_warning` expects inside one fast domain.
TP_AXIS = "tp"


def axes_from_dict(axes: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, axis names) of ``{"dp": 1, "fsdp": 2, "tp": 2}``: insertion order is
    outermost first. Raises :class:`MeshError` for a bad entry or more than
    :data:`MAX_MESH_AXES` axes; the product is checked against the world size later."""
    names = tuple(axes)
    if not names:
        raise MeshError("mesh dict {} has no axes; give at least one, e.g. {'dp': 2}")
    _check_axis_count(names)
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise MeshError(f"mesh axis name {name!r} is not a non-empty string; name every axis")
        if isinstance(size, bool) or not isinstance(size, int):
            raise MeshError(f"mesh axis {name!r} has size {size!r}; give a whole number >= 1")
    return tuple(axes[n] for n in names), names


def tp_axis_warning(
    grid: Sequence[object],
    axis_names: Sequence[str],
    topology: Topology,
) -> str | None:
    """One line naming the first ``"tp"`` group that leaves a fast domain, or None.

    ``grid`` is the rank grid (as :func:`planned_grid` gives it); a tp group is the ranks
    that share every other coordinate. None when the mesh has no ``"tp"`` axis or the
    topology declares no fast domains.
    """
    if TP_AXIS not in axis_names or not topology.fast_domains:
        return None
    ranks = torch.tensor(grid, dtype=torch.long)
    axis = list(axis_names).index(TP_AXIS)
    groups = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()
    per_domain = min(len(d.ranks) for d in topology.fast_domains)
    for group in groups:
        domains = [_domain_name(topology, r) for r in group]
        for i in range(1, len(group)):
            if domains[i] != domains[i - 1]:
                return (
                    f'mesh axis "tp" group {group} spans fast domains {domains[i - 1]} and '
                    f"{domains[i]} (ranks {group[i - 1]} and {group[i]}): tensor-parallel "
                    f'traffic crosses the slow link; put "tp" last (innermost) in the mesh '
                    f"or make it at most {per_domain} ranks (the ranks per fast domain)"
                )
    return None


def _domain_name(topology: Topology, rank: int) -> str:
    domain = topology.domain_of(rank)
    return repr(domain.name) if domain is not None else "(none)"


def factorize_topology(topology: Topology) -> list[list[int]]:
    """The rank grid for ``topology``: one row per fast domain, rows ordered by lowest rank.

    Every rank must sit in exactly one fast domain and all domains must have the same
    size; otherwise :class:`MeshError` says which domain breaks the rule.
    """
    domains = topology.fast_domains
    if not domains:
        raise MeshError(
            "topology declares no fast domains; add 'fast_domains' to the topology file "
            "or build the mesh from a shape"
        )
    sizes = {d.name: len(d.ranks) for d in domains}
    if len(set(sizes.values())) != 1:
        raise MeshError(
            f"fast domains have different sizes {sizes}; a 2-D mesh needs equal domains, "
            "build the mesh from a shape instead"
        )
    covered = sorted(r for d in domains for r in d.ranks)
    if covered != list(range(topology.world_size)):
        missing = sorted(set(range(topology.world_size)) - set(covered))
        raise MeshError(
            f"fast domains do not cover every rank exactly once (missing {missing}); "
            "fix 'fast_domains' in the topology"
        )
    rows = [sorted(d.ranks) for d in domains]
    return sorted(rows, key=lambda row: row[0])


def planned_grid(
    spec_shape: Sequence[int] | None, axis_names: Sequence[str], topology: Topology
) -> list[list[int]] | list[int]:
    """The rank grid a mesh will have, computed without creating any process group:
    ranks in order for a ``spec_shape``, fast domains as rows when it is None."""
    if spec_shape is None:
        return factorize_topology(topology)
    _check_shape(spec_shape, axis_names, topology.world_size)
    grid: list[list[int]] | list[int] = (
        torch.arange(topology.world_size).reshape(tuple(spec_shape)).tolist()
    )
    return grid


def grid_lines(grid: list[list[int]] | list[int], axis_names: Sequence[str]) -> tuple[str, ...]:
    """Canonical text of a mesh (axes, shape, rank grid), as :meth:`DeviceMesh.lines` gives."""
    shape = list(torch.tensor(grid).shape)
    return (f"axes={list(axis_names)}", f"shape={shape}", f"ranks={grid}")


class DeviceMesh:
    """A named grid of ranks with one process group per axis, built on torch's DeviceMesh."""

    def __init__(self, torch_mesh: TorchDeviceMesh, topology: Topology | None = None) -> None:
        self._torch_mesh: TorchDeviceMesh | None = torch_mesh
        self.topology = topology
        #: Groups over 2+ axes (not all), by axes in mesh order: created once, reused.
        self._subset_groups: dict[tuple[str, ...], tuple[dist.ProcessGroup, tuple[int, ...]]] = {}

    @property
    def torch_mesh(self) -> TorchDeviceMesh:
        """The underlying ``torch.distributed.device_mesh.DeviceMesh``."""
        if self._torch_mesh is None:
            raise MeshError("this mesh was released by lamina.shutdown(); call lamina.init()")
        return self._torch_mesh

    def release(self) -> None:
        """Drop the torch mesh (and through it the per-axis process groups)."""
        self._torch_mesh = None
        self._subset_groups.clear()

    @classmethod
    def from_shape(
        cls,
        device_type: str,
        shape: Sequence[int],
        axis_names: Sequence[str],
        topology: Topology | None = None,
    ) -> DeviceMesh:
        """A mesh of the given ``shape`` over ranks in order (``torch`` ``init_device_mesh``)."""
        _check_shape(shape, axis_names, dist.get_world_size())
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(axis_names))
        return cls(mesh, topology)

    @classmethod
    def from_topology(
        cls,
        device_type: str,
        topology: Topology,
        axis_names: tuple[str, str] = TOPOLOGY_AXES,
    ) -> DeviceMesh:
        """A 2-D mesh (domains x ranks per domain): the inner axis stays in a fast domain."""
        world = dist.get_world_size()
        if topology.world_size != world:
            raise MeshError(
                f"topology has {topology.world_size} ranks but the job has {world}; "
                "use a topology that matches WORLD_SIZE"
            )
        grid = torch.tensor(factorize_topology(topology), dtype=torch.int)
        return cls(TorchDeviceMesh(device_type, grid, mesh_dim_names=tuple(axis_names)), topology)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Names of the axes, outermost first."""
        return tuple(self.torch_mesh.mesh_dim_names or ())

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each axis."""
        return tuple(self.torch_mesh.mesh.shape)

    def size(self, axis: str | int | None = None) -> int:
        """Ranks along ``axis``, or in the whole mesh when ``axis`` is None."""
        if axis is None:
            return math.prod(self.shape)
        return self.shape[self._axis_index(axis)]

    def group(self, axis: str | int) -> dist.ProcessGroup:
        """The process group of this rank along ``axis``."""
        return self.torch_mesh.get_group(self._axis_index(axis))

    def group_over(self, axes: Sequence[str]) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
        """This rank's process group spanning the named ``axes``, and its global ranks.

        Every axis: the default group (``None``, the whole job). One axis: that axis's
        group. Any other subset: the torch sub-mesh over those axes (in mesh order),
        flattened into one group. That group is created on the first call for those axes
        (collective: every rank must ask for the same new subsets in the same order) and
        returned again by later calls.
        """
        names = self._ordered(axes)
        if len(names) == len(self.shape):
            return None, tuple(range(self.size()))
        if len(names) == 1:
            group = self.group(names[0])
            return group, tuple(dist.get_process_group_ranks(group))
        cached = self._subset_groups.get(names)
        if cached is None:
            flat = self.torch_mesh[names]._flatten(mesh_dim_name="+".join(names))
            group = flat.get_group()
            cached = (group, tuple(dist.get_process_group_ranks(group)))
            self._subset_groups[names] = cached
        return cached

    def submesh(self, axes: Sequence[str]) -> TorchDeviceMesh:
        """The torch sub-mesh over ``axes`` (one dimension per axis, in mesh order), for
        building DTensors; it reuses the per-axis groups and creates none."""
        return self.torch_mesh[self._ordered(axes)]

    def axes_label(self, axes: Sequence[str]) -> str:
        """``"intra"``, ``"inter+intra"``: the axes in mesh order, as plans name groups."""
        return "+".join(self._ordered(axes))

    def _ordered(self, axes: Sequence[str]) -> tuple[str, ...]:
        for axis in axes:
            self._axis_index(axis)
        if len(set(axes)) != len(axes) or not axes:
            raise MeshError(f"axes {list(axes)} must be distinct mesh axes, at least one")
        return tuple(name for name in self.axis_names if name in axes)

    def lines(self) -> tuple[str, ...]:
        """Canonical text of the mesh (axes, shape and the whole rank grid): equal on every
        rank of a job, so a rank that built another mesh is found by pre-flight."""
        return grid_lines(self.ranks(), self.axis_names)

    def coordinates(self) -> dict[str, int]:
        """This rank's position on every axis, found in the rank grid (torch's own
        ``get_coordinate`` is not set up for every device type: XLA's under torch 2.9)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        found = (self.torch_mesh.mesh == rank).nonzero()
        if found.numel() == 0:
            raise MeshError(f"rank {rank} is not in the mesh's rank grid {self.ranks()}")
        coords: list[int] = found[0].tolist()
        return dict(zip(self.axis_names, coords, strict=True))

    def ranks(self) -> list[list[int]] | list[int]:
        """The rank grid as nested lists."""
        grid: list[list[int]] | list[int] = self.torch_mesh.mesh.tolist()
        return grid

    def _axis_index(self, axis: str | int) -> int:
        if isinstance(axis, int):
            if not 0 <= axis < len(self.shape):
                raise MeshError(f"mesh axis {axis} out of range for shape {self.shape}")
            return axis
        if axis not in self.axis_names:
            raise MeshError(f"unknown mesh axis {axis!r}; axes are {list(self.axis_names)}")
        return self.axis_names.index(axis)

    def __repr__(self) -> str:
        if self._torch_mesh is None:
            return "DeviceMesh(released)"
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        return f"DeviceMesh({self.torch_mesh.device_type}: {axes})"


def _check_axis_count(axis_names: Sequence[str]) -> None:
    if len(axis_names) > MAX_MESH_AXES:
        raise MeshError(
            f"mesh has {len(axis_names)} axes {tuple(axis_names)} but at most {MAX_MESH_AXES} "
            "are supported; merge some axes"
        )


def _check_shape(shape: Sequence[int], axis_names: Sequence[str], world_size: int) -> None:
    _check_axis_count(axis_names)
    if len(shape) != len(axis_names):
        raise MeshError(
            f"mesh shape {tuple(shape)} has {len(shape)} axes but {len(axis_names)} names "
            f"{tuple(axis_names)}; give one name per axis"
        )
    if len(set(axis_names)) != len(axis_names):
        raise MeshError(f"mesh axis names {tuple(axis_names)} repeat; make them unique")
    if any(s < 1 for s in shape):
        raise MeshError(f"mesh shape {tuple(shape)} has an axis smaller than 1")
    if math.prod(shape) != world_size:
        raise MeshError(
            f"mesh shape {tuple(shape)} holds {math.prod(shape)} ranks but the world size is "
            f"{world_size}; pick a shape whose product is {world_size}"
        )
