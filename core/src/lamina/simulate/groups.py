"""The simulated groups of a cluster, one per mesh axis, and the phase times they cost.

The group of a collective is its mesh axis on the simulated cluster:

- axes of the cluster's declared ``mesh`` (``tp``, ``fsdp``, ``dp+fsdp``: ``+`` joins
  axes) are the mesh's groups over them, ranks placed host by host with the last mesh
  axis innermost: ``tp=8`` on 8-device hosts is one host's ranks (the intra link), a
  ``tp=16`` group spans two hosts (its rings cross the inter link), ``fsdp=512`` outside
  it one rank per host, the 8 such groups of a host sharing its uplink; the size is the
  mesh's, never the capture's;
- otherwise ``intra`` is one host's ``L`` ranks; ``inter`` is one rank per host (the
  ``L`` such groups run at once, so each flow gets ``1/L`` of the uplink); ``world`` is
  the whole cluster, and so is any other axis (``dp``) when the plan names only one axis
  and the cluster no mesh (:func:`check_axes` asks for a mesh otherwise).

A :class:`Group` costs the phases of a collective on its cluster cost model (the
formulas are in :mod:`lamina.simulate.timing`), caching each all-reduce size's pick.
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.comm.cost import ALGORITHMS, unavailable_algorithms
from lamina.errors import ConfigError
from lamina.runtime.plan import ExecutionPlan
from lamina.simulate.cluster import WORLD_AXIS, Cluster, ClusterCostModel

#: The mesh axis tensor parallelism runs on.
TP_AXIS = "tp"
#: Axes a topology mesh names, placed without a declared mesh (one host, one rank per
#: host, all).
LEGACY_AXES: tuple[str, ...] = ("intra", "inter", "inter+intra")
#: Link classes, in report order.
LINKS: tuple[str, ...] = ("intra", "inter")


@dataclass(frozen=True)
class PhaseTime:
    """One phase of a collective: its name, the link class that bounds it, its time."""

    name: str
    link: str
    seconds: float


class Group:
    """A simulated group (one mesh axis) with its cost model and cached ring figures."""

    def __init__(
        self,
        label: str,
        model: ClusterCostModel,
        whole_job: bool,
        mesh_axes: tuple[str, ...] = (),
    ) -> None:
        self.label = label
        self.model = model
        self.size = model.layout.size
        self.mesh_axes = mesh_axes  # the declared mesh axes this group spans (none: a legacy axis)
        unavailable = unavailable_algorithms(model.layout, "nccl", whole_job)
        self.allowed = tuple(a for a in ALGORITHMS if a not in unavailable)
        self._chosen: dict[int, tuple[str, int, tuple[PhaseTime, ...]]] = {}

    def _ring(self, topology_order: bool) -> tuple[bool, bool, int]:
        """(has intra edges, has inter edges, uplink sharing) of the ring."""
        layout = self.model.layout
        return self.model.ring_shape(layout.ring_order() if topology_order else layout.rank_order())

    def ring_step(self, nbytes: float, topology_order: bool = True) -> tuple[float, str]:
        """(seconds, bounding link class) of one ring step moving ``nbytes / P``."""
        has_intra, has_inter, share = self._ring(topology_order)
        chunk = nbytes / self.size
        intra = self.model.intra.time(chunk) if has_intra else 0.0
        inter = self.model.inter.time(chunk, share) if has_inter else 0.0
        return (inter, "inter") if has_inter and inter >= intra else (intra, "intra")

    def all_reduce(self, nbytes: int) -> tuple[str, int, tuple[PhaseTime, ...]]:
        """(algorithm, chunks, phases) of the model's pick for an all-reduce."""
        if self.size < 2:
            return "none", 1, ()
        if nbytes not in self._chosen:
            pick = self.model.choose(nbytes, self.allowed)
            phases: tuple[PhaseTime, ...]
            if pick.algorithm in ("flat", "ordered"):
                step, link = self.ring_step(nbytes, pick.algorithm == "ordered")
                half = (self.size - 1) * step
                phases = (
                    PhaseTime("reduce-scatter", link, half),
                    PhaseTime("all-gather", link, half),
                )
            else:
                chunks = pick.chunks if pick.algorithm == "pipelined" else 1
                rs, ar, ag = self.model.phases(nbytes / chunks)
                phases = (
                    PhaseTime("reduce-scatter", "intra", rs),
                    PhaseTime("all-reduce", "inter", ar),
                    PhaseTime("all-gather", "intra", ag),
                )
                if chunks > 1:
                    link = "inter" if ar >= rs + ag else "intra"
                    rest = (chunks - 1) * max(ar, rs + ag)
                    phases += (PhaseTime(f"chunks 2..{chunks}", link, rest),)
            self._chosen[nbytes] = (pick.algorithm, pick.chunks, phases)
        return self._chosen[nbytes]

    def ring_half(self, nbytes: int, name: str) -> tuple[PhaseTime, ...]:
        """A ring all-gather or reduce-scatter: ``P-1`` steps of ``n/P``."""
        if self.size < 2:
            return ()
        step, link = self.ring_step(nbytes)
        return (PhaseTime(name, link, (self.size - 1) * step),)

    def all_to_all(self, nbytes: int) -> tuple[PhaseTime, ...]:
        """Pairwise exchange: ``L-1`` intra and ``P-L`` inter messages of ``n/P``."""
        layout = self.model.layout
        local, chunk = layout.per_host, nbytes / self.size
        out = []
        if local > 1:
            out.append(PhaseTime("exchange", "intra", (local - 1) * self.model.intra.time(chunk)))
        remote = self.size - local
        if remote > 0:
            out.append(PhaseTime("exchange", "inter", remote * self.model.inter.time(chunk, local)))
        return tuple(out)

    @property
    def crosses_hosts(self) -> bool:
        """Whether the group spans two or more hosts (its rings use the inter link)."""
        return self.model.layout.host_count > 1

    def describe(self) -> str:
        """``tp (mesh axis): 8 rank(s) on 1 host(s) x 8, inside one host (intra link); ...``."""
        layout = self.model.layout
        where = ""
        if self.mesh_axes and self.size > 1 and not self.crosses_hosts:
            where = ", inside one host (intra link)"
        elif self.mesh_axes and self.size > 1:
            # tensor parallelism is meant to stay inside a host: say so loudly
            loud = TP_AXIS in self.mesh_axes
            where = (
                f", {'CROSSES HOSTS:' if loud else 'across'} {layout.host_count:,} hosts "
                "(inter-host link)"
            )
        return (
            f"{self.label}: {self.size:,} rank(s) on {layout.host_count} host(s) x "
            f"{layout.per_host}{where}; all-reduce algorithms {list(self.allowed)}"
        )


class Groups:
    """Axis label -> simulated group, built on first use."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._by_kind: dict[str, Group] = {}

    def of(self, axis: str) -> Group:
        """The simulated group of a plan's ``axis`` (see the module docstring)."""
        c = self.cluster
        parts = axis.split("+")
        mesh = [name for name, _ in c.mesh]
        if mesh and all(p in mesh for p in parts):
            kind = "+".join(name for name in mesh if name in parts)
        elif set(parts) in ({"intra"}, {"inter"}):
            kind = parts[0]
        elif axis == WORLD_AXIS or set(parts) == {"inter", "intra"} or not mesh:
            kind = "world"
        else:
            missing = next(p for p in parts if p not in mesh)
            raise ConfigError(
                f'{c.source}: "mesh" {c.describe_mesh()} has no axis {missing!r} (of the '
                f"plan's axis {axis!r}); add it to the mesh (or pass --mesh)"
            )
        if kind not in self._by_kind:
            if kind == "intra":
                group = Group("intra (one host's ranks)", c.host_model(), c.hosts == 1)
            elif kind == "inter":
                label = f"inter (one rank per host, {c.devices_per_host} such groups at once)"
                group = Group(label, c.rail_model(), c.devices_per_host == 1)
            elif kind == "world":
                group = Group(f"{axis} (the whole cluster)", c.cost_model(), True)
            else:
                hosts, per_host = c.mesh_group(tuple(kind.split("+")))
                whole = hosts * per_host == c.world_size
                model = c.group_model(hosts, per_host)
                label = f"{kind} (mesh axis{'es' if '+' in kind else ''})"
                group = Group(label, model, whole, mesh_axes=tuple(kind.split("+")))
            self._by_kind[kind] = group
        return self._by_kind[kind]

    def described(self) -> tuple[str, ...]:
        """One line per group used, in first-use order."""
        return tuple(g.describe() for g in self._by_kind.values())


def plan_axes(plan: ExecutionPlan) -> tuple[str, ...]:
    """The axes the plan's collectives (and HSDP replicas) run on, in first-use order."""
    axes = [n.collective.axis for n in plan.collectives() if n.collective is not None]
    if plan.replicate_axis:
        axes.append(plan.replicate_axis)
    return tuple(dict.fromkeys(axes))


def check_axes(plan: ExecutionPlan, cluster: Cluster) -> None:
    """ConfigError, one line naming the cluster's ``mesh`` and the fix, when the plan's
    axes cannot be placed on the cluster: an axis the declared mesh lacks, or no mesh to
    size ``tp`` or two or more axes (``tp`` and ``fsdp``)."""
    named = [
        part
        for axis in plan_axes(plan)
        for part in axis.split("+")
        if part != WORLD_AXIS and axis not in LEGACY_AXES
    ]
    named = list(dict.fromkeys(named))
    mesh = dict(cluster.mesh)
    if mesh:
        missing = [a for a in named if a not in mesh]
        if missing:
            raise ConfigError(
                f'{cluster.source}: "mesh" {cluster.describe_mesh()} has no axis '
                f"{missing[0]!r}, which the {plan.strategy} plan's collectives use (axes "
                f"{named}); name every one of them in the mesh (or pass --mesh)"
            )
        return
    labels = [a for a in plan_axes(plan) if a not in (WORLD_AXIS, *LEGACY_AXES)]
    if len(labels) > 1 or TP_AXIS in named:  # one label alone (dp, dp+fsdp): the whole job
        example = ", ".join(f'"{a}": {s}' for a, s in _example_mesh(named, cluster).items())
        raise ConfigError(
            f'{cluster.source}: "mesh" is missing: the {plan.strategy} plan\'s collectives '
            f"run on axes {named}, whose simulated sizes the cluster must declare, outermost "
            f'first; add e.g. "mesh": {{{example}}} (or pass --mesh)'
        )


def _example_mesh(named: list[str], cluster: Cluster) -> dict[str, int]:
    """A mesh for ``named`` on ``cluster``: the innermost axis (``tp`` if named) one host,
    the first other axis the hosts, any others 1."""
    local, hosts = cluster.devices_per_host, cluster.world_size // cluster.devices_per_host
    inner = "tp" if "tp" in named else named[-1]
    outer = [a for a in named if a != inner] or (["dp"] if hosts > 1 else [])
    sizes = {a: 1 for a in outer}
    if outer:
        sizes[outer[0]] = hosts
    sizes[inner] = local
    return sizes


__all__ = ["LINKS", "Group", "Groups", "PhaseTime", "check_axes", "plan_axes"]
