"""An alpha-beta cost model of the collective algorithms, per link class.

A message of ``n`` bytes over one link costs ``alpha + n * beta``: ``alpha`` the
per-message latency, ``beta`` the seconds per byte of the link (one direction). There
are two link classes: *intra* (between ranks of one host: shared memory, NVLink) and
*inter* (a host's uplink to the others). Flows that leave one host at the same time
share its uplink, so a step in which ``c`` of them cross it moves at ``1/c`` of its
bandwidth.

The algorithms (``lamina.comm.algorithms`` runs them), for a group of ``P = H x L``
ranks on ``H`` hosts with ``L`` ranks each:

- ``flat``: the group's own all-reduce, modelled as a ring over the ranks in rank
  order: ``2(P-1)`` steps of ``n/P`` bytes, each as slow as its slowest edge. Launched
  with hosts interleaved, every edge crosses hosts and each uplink carries ``P/H`` of
  them.
- ``ordered``: the same ring with the ranks in topology order (each host's ranks in a
  row): every uplink carries one crossing.
- ``hierarchical``: reduce-scatter inside each host (``L-1`` steps of ``n/L``), then
  the ``L`` cross-host groups all-reduce their ``n/L`` shard at once (``2(H-1)`` steps
  of ``n/(LH)``, ``L`` flows per uplink), then all-gather inside each host.
- ``pipelined``: the hierarchical phases on ``k`` chunks, the intra phases of one chunk
  overlapping the inter phase of another: one chunk's three phases, then ``k-1`` times
  the slower of (inter phase, intra phases) per chunk; ``k`` is the best of
  :data:`PIPELINE_CHUNKS`.

ZeRO-3's gathers and reduce-scatters have two algorithms (:meth:`CostModel.sharded`,
run by :mod:`lamina.memory.hierarchy`): ``flat`` (half a ring all-reduce in rank order)
and ``hierarchical`` (the intra-host phase, then half the cross-host phase).

The model's link figures come from the topology (``lamina topo probe`` measures them)
or from :func:`lamina.comm.calibrate.calibrate` (phases timed on the job itself). Every
rank computes the same figures from the same topology, so every rank makes the same
choice; the plan records it and pre-flight compares it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from lamina.comm.layout import HostLayout, hierarchy_unavailable
from lamina.device.topology import LinkProfile, Topology
from lamina.errors import ConfigError
from lamina.units import format_bytes

#: Algorithm names, in the order tables list them.
ALGORITHMS: tuple[str, ...] = ("flat", "ordered", "hierarchical", "pipelined")
#: Chunk counts the pipelined algorithm considers.
PIPELINE_CHUNKS: tuple[int, ...] = (2, 4, 8)
#: A pipelined chunk is never smaller than this (smaller chunks only add latency).
MIN_CHUNK_BYTES = 64 << 10


@dataclass(frozen=True)
class LinkCost:
    """``alpha`` seconds per message and ``beta`` seconds per byte of one link class."""

    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def of(cls, profile: LinkProfile) -> LinkCost:
        """From a topology link profile (latency in us, bandwidth in GB/s)."""
        return cls(profile.latency_us * 1e-6, 1.0 / (profile.bandwidth_gbps * 1e9))

    def time(self, nbytes: float, sharing: int = 1) -> float:
        """One message of ``nbytes`` while ``sharing`` flows share the link."""
        return self.alpha_s + nbytes * self.beta_s_per_byte * max(1, sharing)

    @property
    def bandwidth_gbps(self) -> float:
        """GB/s of one flow alone on the link."""
        return 1.0 / self.beta_s_per_byte / 1e9


@dataclass(frozen=True)
class Prediction:
    """The model's time for one algorithm at one size, and the chunk count it assumed."""

    algorithm: str
    nbytes: int
    seconds: float
    chunks: int = 1
    available: bool = True
    why_not: str = ""


@dataclass(frozen=True)
class CostModel:
    """Link costs inside a host and between hosts, for one group's :class:`HostLayout`."""

    layout: HostLayout
    intra: LinkCost
    inter: LinkCost
    source: str = "topology"

    @classmethod
    def from_topology(cls, topology: Topology, ranks: Iterable[int] | None = None) -> CostModel:
        """The model of ``ranks`` (default all) from the topology's links: the slowest
        link inside a host and the slowest link between hosts of the group."""
        layout = HostLayout.of(topology, list(ranks) if ranks is not None else None)
        intra: list[LinkProfile] = []
        inter: list[LinkProfile] = []
        members = layout.ring_order()
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                same = layout.host_of(a) == layout.host_of(b)
                (intra if same else inter).append(topology.link(a, b))
        slowest_intra = min(intra, key=lambda p: p.bandwidth_gbps, default=None)
        slowest_inter = min(inter, key=lambda p: p.bandwidth_gbps, default=topology.default_link)
        inter_cost = LinkCost.of(slowest_inter)
        intra_cost = LinkCost.of(slowest_intra) if slowest_intra else inter_cost
        source = "measured" if any(p.source == "measured" for p in intra + inter) else "topology"
        return cls(layout, intra_cost, inter_cost, source)

    # -- predictions ----------------------------------------------------------------------
    def ring_all_reduce(self, order: tuple[int, ...], nbytes: float) -> float:
        """A ring all-reduce over ``order``: ``2(P-1)`` steps, each its slowest edge."""
        p = len(order)
        if p < 2:
            return 0.0
        chunk = nbytes / p
        share = self.layout.crossings(order)
        step = 0.0
        for k, rank in enumerate(order):
            nxt = order[(k + 1) % p]
            same = self.layout.host_of(rank) == self.layout.host_of(nxt)
            edge = self.intra.time(chunk) if same else self.inter.time(chunk, share)
            step = max(step, edge)
        return 2 * (p - 1) * step

    def phases(self, nbytes: float) -> tuple[float, float, float]:
        """(intra reduce-scatter, inter all-reduce, intra all-gather) of ``nbytes``."""
        hosts, local = self.layout.host_count, self.layout.per_host
        intra = (local - 1) * self.intra.time(nbytes / local)
        shard = nbytes / local
        inter = 2 * (hosts - 1) * self.inter.time(shard / hosts, local) if hosts > 1 else 0.0
        return intra, inter, intra

    def hierarchical(self, nbytes: float) -> float:
        """Reduce-scatter inside hosts, all-reduce across, all-gather inside."""
        return sum(self.phases(nbytes))

    def pipelined(self, nbytes: float) -> tuple[float, int]:
        """(seconds, chunks) of the best pipelined schedule."""
        best = (self.hierarchical(nbytes), 1)
        for chunks in PIPELINE_CHUNKS:
            if nbytes / chunks < MIN_CHUNK_BYTES:
                break
            rs, ar, ag = self.phases(nbytes / chunks)
            seconds = rs + ar + ag + (chunks - 1) * max(ar, rs + ag)
            if seconds < best[0]:
                best = (seconds, chunks)
        return best

    def sharded(self, algorithm: str, nbytes: float) -> float:
        """A reduce-scatter (or all-gather: the same steps backwards) of an ``nbytes``
        buffer: ``flat`` a ring in rank order, ``P-1`` steps of ``n/P``; ``hierarchical``
        the intra-host phase (``L-1`` steps of ``n/L``), then the ``L`` cross-host groups
        at once (``H-1`` steps of ``n/(LH)``, ``L`` flows per uplink)."""
        if algorithm == "flat":
            return self.ring_all_reduce(self.layout.rank_order(), nbytes) / 2
        if algorithm != "hierarchical":
            raise ConfigError(
                f"unknown sharded algorithm {algorithm!r}; choose from {list(SHARDED_ALGORITHMS)}"
            )
        intra, inter, _ = self.phases(nbytes)
        return intra + inter / 2

    def availability(self, algorithm: str) -> str:
        """'' when ``algorithm`` can run on this layout, else why not."""
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"unknown algorithm {algorithm!r}; choose from {list(ALGORITHMS)}")
        return "" if algorithm in ("flat", "ordered") else hierarchy_unavailable(self.layout)

    def predict(self, algorithm: str, nbytes: int) -> Prediction:
        """The predicted time of ``algorithm`` on an all-reduce of ``nbytes``."""
        why_not = self.availability(algorithm)
        if why_not:
            return Prediction(algorithm, nbytes, float("inf"), available=False, why_not=why_not)
        if algorithm == "flat":
            return Prediction(
                algorithm, nbytes, self.ring_all_reduce(self.layout.rank_order(), nbytes)
            )
        if algorithm == "ordered":
            return Prediction(
                algorithm, nbytes, self.ring_all_reduce(self.layout.ring_order(), nbytes)
            )
        if algorithm == "hierarchical":
            return Prediction(algorithm, nbytes, self.hierarchical(nbytes))
        seconds, chunks = self.pipelined(nbytes)
        return Prediction(algorithm, nbytes, seconds, chunks)

    def predictions(self, nbytes: int) -> list[Prediction]:
        """Every algorithm's prediction at ``nbytes``, in :data:`ALGORITHMS` order."""
        return [self.predict(a, nbytes) for a in ALGORITHMS]

    def choose(self, nbytes: int, allowed: Iterable[str] = ALGORITHMS) -> Prediction:
        """The fastest available algorithm of ``allowed``; ties keep the simpler one
        (``flat`` first), and an algorithm must beat the simpler ones by 2% to be
        chosen, so noise in the figures does not flip the choice."""
        chosen: Prediction | None = None
        for prediction in self.predictions(nbytes):
            if prediction.algorithm not in set(allowed) or not prediction.available:
                continue
            if chosen is None or prediction.seconds < 0.98 * chosen.seconds:
                chosen = prediction
        if chosen is None:
            raise ConfigError(f"none of the algorithms {list(allowed)} can run on this group")
        return chosen

    # -- reporting ------------------------------------------------------------------------
    def describe(self) -> str:
        """One line: the layout and the two link classes."""
        layout = self.layout
        return (
            f"{layout.size} rank(s) on {layout.host_count} host(s) x {layout.per_host}; "
            f"intra {_link(self.intra)}, inter {_link(self.inter)} ({self.source})"
        )

    def table(self, sizes: Iterable[int]) -> str:
        """Predicted milliseconds per algorithm and size, and the choice."""
        header = f"{'size':>10}" + "".join(f"{a:>14}" for a in ALGORITHMS) + "  choice"
        lines = [header]
        for nbytes in sizes:
            cells = []
            for p in self.predictions(nbytes):
                cells.append(f"{p.seconds * 1e3:14.2f}" if p.available else f"{'-':>14}")
            choice = self.choose(nbytes)
            chunks = f" ({choice.chunks} chunks)" if choice.chunks > 1 else ""
            lines.append(
                f"{format_bytes(nbytes):>10}" + "".join(cells) + f"  {choice.algorithm}{chunks}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The figures as plain data."""
        return {
            "hosts": [list(h) for h in self.layout.hosts],
            "intra": asdict(self.intra),
            "inter": asdict(self.inter),
            "source": self.source,
        }


def _link(cost: LinkCost) -> str:
    return f"{cost.alpha_s * 1e6:.1f} us + {cost.bandwidth_gbps:.4g} GB/s"


def unavailable_algorithms(layout: HostLayout, pg_backend: str, whole_job: bool) -> dict[str, str]:
    """Algorithm -> why it cannot run for a group of ``layout`` on a ``pg_backend``
    process group (``whole_job``: the group spans every rank of the job)."""
    out: dict[str, str] = {}
    if layout.ring_order() != layout.rank_order() and pg_backend != "gloo":
        out["ordered"] = f"{pg_backend} orders its own rings by topology; flat is that ring"
    why = hierarchy_unavailable(layout)
    if not why and not whole_job:
        why = "hierarchical groups are built for a group spanning the whole job"
    if why:
        out["hierarchical"] = out["pipelined"] = why
    return out


@dataclass(frozen=True)
class AlgorithmChoice:
    """The algorithm one collective runs, as the plan records it."""

    algorithm: str
    chunks: int
    #: (algorithm, predicted seconds) of every algorithm that can run.
    predictions: tuple[tuple[str, float], ...]
    #: Why the requested algorithm was replaced by ``flat`` ('' when it was not).
    fallback_reason: str = ""
    requested: str = "auto"


#: What ``algorithm=`` accepts.
ALGORITHM_OPTIONS: tuple[str, ...] = ("auto", *ALGORITHMS)
#: The algorithms of ZeRO-3's gathers and reduce-scatters (:meth:`CostModel.sharded`).
SHARDED_ALGORITHMS: tuple[str, ...] = ("flat", "hierarchical")
#: What the sharded strategies' ``algorithm=`` accepts.
SHARDED_OPTIONS: tuple[str, ...] = ("auto", *SHARDED_ALGORITHMS)


def choose_algorithm(
    model: CostModel, nbytes: int, requested: str, unavailable: dict[str, str]
) -> AlgorithmChoice:
    """The algorithm for an all-reduce of ``nbytes``: the model's pick among those that
    can run (``requested="auto"``), or ``requested`` itself, replaced by ``flat`` with
    the reason when it cannot run."""
    if requested not in ALGORITHM_OPTIONS:
        raise ConfigError(f"algorithm={requested!r} is not one of {list(ALGORITHM_OPTIONS)}")
    runnable = [a for a in ALGORITHMS if a not in unavailable]
    predictions = tuple(
        (p.algorithm, p.seconds) for p in model.predictions(nbytes) if p.algorithm in runnable
    )
    if requested == "auto":
        pick = model.choose(nbytes, runnable)
        return AlgorithmChoice(pick.algorithm, pick.chunks, predictions)
    if requested in unavailable:
        return AlgorithmChoice("flat", 1, predictions, unavailable[requested], requested)
    return AlgorithmChoice(
        requested, model.predict(requested, nbytes).chunks, predictions, "", requested
    )


def choose_sharded_algorithm(
    model: CostModel, nbytes: int, requested: str, unavailable: dict[str, str]
) -> AlgorithmChoice:
    """The algorithm of a unit's gathers and reduce-scatter (``nbytes``: the unsharded
    buffer), like :func:`choose_algorithm` among :data:`SHARDED_ALGORITHMS`."""
    if requested not in SHARDED_OPTIONS:
        raise ConfigError(f"algorithm={requested!r} is not one of {list(SHARDED_OPTIONS)}")
    predictions = tuple(
        (a, model.sharded(a, nbytes)) for a in SHARDED_ALGORITHMS if a not in unavailable
    )
    if requested == "auto":
        best = predictions[0]
        for candidate in predictions[1:]:
            if candidate[1] < 0.98 * best[1]:
                best = candidate
        return AlgorithmChoice(best[0], 1, predictions)
    if requested in unavailable:
        return AlgorithmChoice("flat", 1, predictions, unavailable[requested], requested)
    return AlgorithmChoice(requested, 1, predictions, "", requested)
