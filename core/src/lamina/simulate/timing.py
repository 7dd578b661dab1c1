"""The predicted time of each collective node of a plan on its simulated group.

Time (the alpha-beta model of :mod:`lamina.comm.cost`; ``alpha`` the latency of one
message, ``beta`` seconds per byte; a group of ``P = H x L`` ranks, ``H`` hosts of ``L``):

- **all-reduce** (DP gradient buckets, HSDP replica all-reduces, buffers are broadcasts):
  the algorithm :meth:`CostModel.choose <lamina.comm.cost.CostModel.choose>` picks, as
  ``algorithm="auto"`` does on the real job; ``flat`` / ``ordered`` are rings of
  ``2(P-1)`` steps of ``n/P`` bytes, each step as slow as its slowest edge (an inter
  edge shares its host's uplink with the other edges leaving the host); the halves are
  reported as the reduce-scatter and the all-gather, on the bottleneck's link class.
  ``hierarchical``: intra reduce-scatter ``(L-1)(alpha + n/L beta_intra)``, inter
  all-reduce ``2(H-1)(alpha + n/(LH) L beta_up)`` (``L`` flows share the uplink), intra
  all-gather as the reduce-scatter. ``pipelined`` on ``k`` chunks: one chunk's three
  phases, then ``k-1`` times the slower of (inter phase, intra phases), counted on the
  slower one's link class.
- **all-gather / reduce-scatter** (ZeRO-3 and HSDP unit gathers and gradient
  reduce-scatters): a ring over the group in topology order, ``P-1`` steps of ``n/P``
  bytes (``n`` the full unit), each step ``max(alpha_intra + n/P beta_intra,
  alpha_inter + n/P c beta_up)`` with ``c`` the ring edges leaving one host (1 when the
  ranks are placed host by host): ``(P-1)`` alphas, and ``(P-1)/P n`` bytes through the
  bottleneck link.
- **broadcast**: scatter then ring all-gather (van de Geijn): ``2(P-1)`` steps of
  ``n/P``, costed like the ring all-reduce in topology order.
- **tensor-parallel activation collectives** (``Collective(purpose="activation")``, one
  per layer collective of the step): the same formulas on the ``tp`` group of the
  simulated mesh, ``n`` the full activation of the captured microbatch (not scaled by the
  data-parallel world): inside one host an all-reduce ring is
  ``2(P-1)(alpha_intra + n/P beta_intra)`` and an all-gather or reduce-scatter
  ``(P-1)(alpha_intra + n/P beta_intra)``; a tp group across hosts pays the inter edge.
- **all-to-all**: pairwise exchange, ``L-1`` intra messages and ``P-L`` inter messages of
  ``n/P``, the ``L`` ranks of a host sharing its uplink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.errors import ConfigError
from lamina.runtime.nodes import Collective
from lamina.runtime.plan import PlanNode
from lamina.simulate.groups import Groups, PhaseTime


@dataclass(frozen=True)
class CollectiveTime:
    """The predicted time of one collective node of the plan on the cluster."""

    node: str
    #: The operation as modelled (all_reduce, all_gather, reduce_scatter, broadcast, ...).
    op: str
    #: The step phase of the node (forward, backward, setup).
    step_phase: str
    nbytes: int
    group_size: int
    axis: str
    algorithm: str
    chunks: int
    phases: tuple[PhaseTime, ...]
    #: Why the node runs (the plan's ``Collective.purpose``: gradient, activation, ...).
    purpose: str = ""
    #: The module whose activations a tensor-parallel collective carries ("" otherwise).
    layer: str = ""

    @property
    def seconds(self) -> float:
        """The whole collective."""
        return sum(p.seconds for p in self.phases)

    def link_seconds(self, link: str) -> float:
        """The part of it bound by ``link`` ("intra" or "inter")."""
        return sum(p.seconds for p in self.phases if p.link == link)

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds)."""
        return {
            "node": self.node,
            "purpose": self.purpose,
            "layer": self.layer,
            "op": self.op,
            "step_phase": self.step_phase,
            "bytes": self.nbytes,
            "group_size": self.group_size,
            "axis": self.axis,
            "algorithm": self.algorithm,
            "chunks": self.chunks,
            "seconds": self.seconds,
            "intra_s": self.link_seconds("intra"),
            "inter_s": self.link_seconds("inter"),
            "phases": [{"name": p.name, "link": p.link, "seconds": p.seconds} for p in self.phases],
        }


def modelled_op(node: PlanNode) -> str:
    """The collective a node performs, whatever primitive the capture's backend used for
    it (gloo gathers by broadcast and reduce-scatters by all-to-all)."""
    spec = node.collective
    assert spec is not None
    if node.kind == "gather":
        return "all_gather"
    if node.scatters_gradient:
        return "reduce_scatter"
    return spec.op


def predict_collective(groups: Groups, node: PlanNode) -> CollectiveTime:
    """The time of one collective node on the simulated group of its axis."""
    spec = node.collective
    if spec is None:
        raise ConfigError(f"plan node {node.id!r} is not a collective")
    group = groups.of(spec.axis)
    op = modelled_op(node)
    nbytes = spec.nbytes
    algorithm, chunks = "ring", 1
    if op == "all_reduce":
        algorithm, chunks, phases = group.all_reduce(nbytes)
    elif op == "all_gather":
        phases = group.ring_half(nbytes, "all-gather")
    elif op == "reduce_scatter":
        phases = group.ring_half(nbytes, "reduce-scatter")
    elif op == "broadcast":
        algorithm = "scatter+all-gather"
        phases = group.ring_half(nbytes, "scatter") + group.ring_half(nbytes, "all-gather")
    elif op == "all_to_all":
        algorithm = "pairwise"
        phases = group.all_to_all(nbytes) if group.size > 1 else ()
    else:
        raise ConfigError(
            f"plan node {node.id!r}: collective {op!r} has no model; lamina plan --simulate "
            "models all_reduce, all_gather, reduce_scatter, broadcast and all_to_all"
        )
    facts = node.facts(Collective)
    purpose = facts.purpose if facts is not None else "gather"
    layer = facts.layer if facts is not None else ""
    return CollectiveTime(
        node.id,
        op,
        node.phase,
        nbytes,
        group.size,
        spec.axis,
        algorithm,
        chunks,
        phases,
        purpose,
        layer,
    )


def replica_all_reduce(groups: Groups, scatter: PlanNode, axis: str) -> CollectiveTime:
    """The all-reduce of one unit's shard gradient across the replicas (HSDP), after the
    unit's reduce-scatter ``scatter``: ``ceil(n_u / N)`` elements with ``N`` the simulated
    shard group. Derived from the unit, not read from the plan: a capture on one host has
    a single replica (no such node), and the capture's shard is not the simulated one."""
    spec = scatter.collective
    assert spec is not None
    shard = groups.of(spec.axis).size
    nbytes = -(-spec.numel // shard) * spec.element_size
    group = groups.of(axis)
    algorithm, chunks, phases = group.all_reduce(nbytes)
    return CollectiveTime(
        f"{scatter.unit}.all_reduce.replicas",
        "all_reduce",
        scatter.phase,
        nbytes,
        group.size,
        axis,
        algorithm,
        chunks,
        phases,
        "replicate",
    )


__all__ = ["CollectiveTime", "modelled_op", "predict_collective", "replica_all_reduce"]
