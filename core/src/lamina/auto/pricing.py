"""What each node of a candidate's plan costs on this job: :class:`PlanPrices`.

The plan (:mod:`lamina.auto.plans`) says what runs; this prices it from what ``"auto"``
measured, for :func:`lamina.simulate.step.price_step` to simulate the step:

- a whole-model forward or backward: the measured one on this rank's share of the
  global batch (under tensor parallelism each rank computes ``1/T`` of ``T`` times the
  rows: the same);
- a ZeRO-3 unit's forward or backward: its share of the whole one, the measured
  seconds of its blocks (``blocks.0..blocks.3`` spans four) against the blocks' and the
  rest's together; the unit holding no block (the root) gets the rest's share;
- a pipeline stage's: the seconds its plan gives (the cut's measured blocks), times
  ``stage_scale`` (1 on the job; on a declared cluster the planning rank's times brought
  to this job's measurement, :mod:`lamina.auto.cluster_plans`);
- the optimizer: AdamW's measured step scaled to the parameters the busiest rank
  holds, plus the DTensor dispatch cost where they are DTensors;
- every compute node times ``compute_scale``: 1 for the prediction, the measured
  spread's quartiles over the median for its interval;
- a collective: the alpha-beta fit of its op on the group of its axes
  (:class:`~lamina.auto.comm.CommCosts`), its bytes as the plan says; a broadcast is
  priced as an all-reduce of its bytes and an all-to-all as a reduce-scatter of them (a
  ring moving ``(P - 1) / P`` of the buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from lamina.auto.comm import CommCosts
from lamina.auto.measure import ModelProfile
from lamina.auto.plans import CandidatePlan
from lamina.runtime.nodes import Compute
from lamina.runtime.plan import PlanNode
from lamina.simulate.step import PricedStep, price_step

#: How ops the fits do not time are priced: as the fitted op moving the same bytes.
PRICED_AS = {"broadcast": "all_reduce", "all_to_all": "reduce_scatter"}


@dataclass(frozen=True)
class PlanPrices:
    """Prices of one candidate's plan nodes on this job (see the module)."""

    profile: ModelProfile
    comm: CommCosts
    planned: CandidatePlan
    #: The mesh's axes in order (what a plan's ``world`` axis spans).
    mesh_axes: tuple[str, ...]
    #: Every compute node's measured seconds times this (an end of the measured spread).
    compute_scale: float = 1.0
    #: A pipeline stage node's seconds (what its plan gives) times this.
    stage_scale: float = 1.0

    @property
    def overlap(self) -> float:
        """The measured share of communication compute hides."""
        return self.comm.overlap

    @property
    def skew(self) -> float:
        """The measured wait for the last rank at a blocking collective."""
        return self.comm.skew

    def compute(self, node: PlanNode) -> float:
        """A forward, backward or optimizer node's seconds."""
        return self._measured(node) * self.compute_scale

    def _measured(self, node: PlanNode) -> float:
        p = self.profile
        detail = node.detail
        if node.kind == "optimizer":
            share = self.planned.held_numel / max(1, p.parameters)
            return p.optimizer_s * share + (p.optimizer_dispatch_s if self.planned.dtensors else 0)
        if isinstance(detail, Compute) and detail.rank is not None and detail.seconds is not None:
            return detail.seconds * self.stage_scale
        whole = p.forward_s if node.kind == "forward" else p.backward_s
        unit = detail.unit if isinstance(detail, Compute) else ""
        return whole * self.unit_share(unit) if unit else whole

    def unit_share(self, unit: str) -> float:
        """The share of the model's compute a ZeRO-3 unit's blocks take (see the module)."""
        chain = self.profile.chain
        if chain is None:
            return 1.0 / max(1, self._units())
        names = chain.chain.blocks
        costs = chain.costs
        total = sum(costs.blocks) + costs.rest
        if total <= 0:
            return 1.0 / max(1, self._units())
        first, _, last = unit.partition("..")
        if first in names:
            stop = names.index(last) if last in names else names.index(first)
            return sum(costs.blocks[names.index(first) : stop + 1]) / total
        rests = [u for u in self._unit_names if u.partition("..")[0] not in names]
        return costs.rest / total / max(1, len(rests))

    @cached_property
    def _unit_names(self) -> list[str]:
        return sorted(
            {n.detail.unit for n in self.planned.plan.nodes if isinstance(n.detail, Compute)} - {""}
        )

    def _units(self) -> int:
        return len(self._unit_names)

    def collective(self, node: PlanNode, op: str) -> float:
        """A collective or gather node's seconds on its group."""
        spec = node.collective
        assert spec is not None
        return self.comm.seconds(PRICED_AS.get(op, op), self.axes_of(spec.axis), spec.nbytes)

    def transfer(self, nbytes: int, axis: str) -> float:
        """One pipeline message along ``axis``."""
        return self.comm.seconds("send", self.axes_of(axis), nbytes)

    def axes_of(self, axis: str) -> tuple[str, ...]:
        """The mesh axes a plan's axis names (``inter+intra``; ``world``: all of them)."""
        return self.mesh_axes if axis == "world" else tuple(axis.split("+"))


def priced_with_spread(
    prices: PlanPrices, spread: tuple[float, float]
) -> tuple[PricedStep, float, float]:
    """The candidate's plan priced by ``prices`` (:func:`lamina.simulate.step.price_step`),
    and its step with every compute node at each end of the measured ``spread`` (the
    quartiles over the median)."""
    planned = prices.planned
    priced = price_step(planned.plan, prices, planned.pipeline)
    low, high = (
        price_step(planned.plan, replace(prices, compute_scale=end), planned.pipeline).step_s
        for end in spread
    )
    return priced, low, high


__all__ = ["PRICED_AS", "PlanPrices", "priced_with_spread"]
