"""The simulated groups of a cluster, one per mesh axis, and the phase times they cost.

The group of a collective is its mesh axis on the simulated cluster: ``intra`` is one
host's ``L`` ranks; ``inter`` is one rank per host (the ``L`` such groups run at once, so
each flow gets ``1/L`` of the uplink); any other axis (``world``, ``dp``, ``inter+intra``)
is the whole cluster.

A :class:`Group` costs the phases of a collective on its cluster cost model (the
formulas are in :mod:`lamina.simulate.timing`), caching each all-reduce size's pick.
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.comm.cost import ALGORITHMS, unavailable_algorithms
from lamina.simulate.cluster import Cluster, ClusterCostModel

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

    def __init__(self, label: str, model: ClusterCostModel, whole_job: bool) -> None:
        self.label = label
        self.model = model
        self.size = model.layout.size
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

    def describe(self) -> str:
        layout = self.model.layout
        return (
            f"{self.label}: {self.size:,} rank(s) on {layout.host_count} host(s) x "
            f"{layout.per_host}; all-reduce algorithms {list(self.allowed)}"
        )


class Groups:
    """Axis label -> simulated group, built on first use."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._by_kind: dict[str, Group] = {}

    def of(self, axis: str) -> Group:
        parts = set(axis.split("+"))
        kind = "intra" if parts == {"intra"} else "inter" if parts == {"inter"} else "world"
        if kind not in self._by_kind:
            c = self.cluster
            if kind == "intra":
                group = Group("intra (one host's ranks)", c.host_model(), c.hosts == 1)
            elif kind == "inter":
                label = f"inter (one rank per host, {c.devices_per_host} such groups at once)"
                group = Group(label, c.rail_model(), c.devices_per_host == 1)
            else:
                group = Group(f"{axis} (the whole cluster)", c.cost_model(), True)
            self._by_kind[kind] = group
        return self._by_kind[kind]

    def described(self) -> tuple[str, ...]:
        return tuple(g.describe() for g in self._by_kind.values())


__all__ = ["LINKS", "Group", "Groups", "PhaseTime"]
