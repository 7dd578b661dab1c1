"""The model state each rank of a plan holds on a cluster, by the ZeRO formulas.

Memory per rank (model state: parameters, gradients, optimizer state; ``P``, ``G``
bytes per parameter and gradient element, ``K = 8`` for AdamW's two fp32 moments):

- replicated (DP): ``(P + G + K) x Psi`` with ``Psi`` the elements the gradient buckets
  carry (alignment padding included);
- sharded (ZeRO-3 / HSDP over a shard group of ``N`` ranks):
  ``(P + G + K) x S`` with ``S = sum over units of ceil(n_u / N)`` (about ``Psi / N``),
  plus the transient gathered units: those gathered for the whole forward (kept, with
  their full gradient, through backward) and the largest other unit with its full
  gradient before its reduce-scatter. Prefetching a second unit would add one more;
- split by tensor parallelism alone (a ``tp`` plan: no gradient collective, no gather):
  ``(P + G + K) x ceil(Psi / T)`` with ``Psi`` the elements of the wrap-time broadcast
  (the whole model) and ``T`` the simulated tp group, as if every parameter were split
  (the replicated norms are not told apart);
- split by pipeline stages (a ``pp`` plan, whose stage nodes carry their parameter
  counts): ``(P + G + K) x S`` with ``S`` the largest pipeline rank's stages' elements
  (each held whole, fp32), of ``Psi`` the whole model (the wrap-time broadcast).

A composed plan (``tp+zero3``) is sharded as ZeRO-3 says, over the units the capture
planned: those hold the capture's tp-local tensors, so its state is the capture's tp
split divided over the simulated shard group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.errors import ConfigError
from lamina.runtime.nodes import Collective, Compute, Gather
from lamina.runtime.plan import ExecutionPlan, PlanNode
from lamina.simulate.cluster import Cluster
from lamina.simulate.groups import Groups
from lamina.simulate.pipeline import pipeline_axis
from lamina.units import format_bytes

#: Bytes of optimizer state per parameter element: AdamW's two fp32 moments.
ADAMW_BYTES_PER_PARAM = 8.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Model state per rank, by the ZeRO formulas (see the module docstring)."""

    strategy: str
    #: N: ranks the state is sharded over (1: replicated).
    shard_group: int
    #: Psi: parameter elements as the plan moves them (padding included).
    param_elements: int
    #: Elements each rank holds (Psi when replicated, sum of ceil(n_u / N) when sharded).
    local_elements: int
    param_bytes_per_element: float
    grad_bytes_per_element: float
    optimizer_bytes_per_element: float
    #: Transient gathered units (sharded only): parameters plus their full gradients.
    gathered_bytes: int = 0
    gathered_what: str = ""
    device_memory_bytes: int | None = None
    #: The axis that splits the state when it is not ZeRO sharding ("tp", a pipeline's
    #: axis), else "".
    split_axis: str = ""
    #: How the split gives S, when not ``ceil(Psi / N)`` (a pipeline's stages).
    split_rule: str = ""

    @property
    def parameters(self) -> int:
        """Bytes of parameters per rank."""
        return round(self.param_bytes_per_element * self.local_elements)

    @property
    def gradients(self) -> int:
        """Bytes of gradients per rank."""
        return round(self.grad_bytes_per_element * self.local_elements)

    @property
    def optimizer_state(self) -> int:
        """Bytes of optimizer state per rank."""
        return round(self.optimizer_bytes_per_element * self.local_elements)

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def peak(self) -> int:
        """State plus the transient gathered units."""
        return self.state + self.gathered_bytes

    def rows(self) -> list[tuple[str, int, str]]:
        """(what, bytes, formula) rows of the report."""
        p, g, k = (
            self.param_bytes_per_element,
            self.grad_bytes_per_element,
            self.optimizer_bytes_per_element,
        )
        n = self.shard_group
        if n == 1:
            count = f"Psi = {self.param_elements:,}"
        elif self.split_axis:
            rule = self.split_rule or f"ceil(Psi / {n:,})"
            count = (
                f"S = {rule} = {self.local_elements:,}, Psi = "
                f"{self.param_elements:,} split over {self.split_axis}={n:,}"
            )
        else:
            count = (
                f"S = sum ceil(n_u / {n:,}) = {self.local_elements:,} (Psi / N = "
                f"{self.param_elements / n:,.1f})"
            )
        elems = "Psi" if n == 1 else "S"
        rows = [
            ("parameters", self.parameters, f"P x {elems} = {p:g} B x {self.local_elements:,}"),
            ("gradients", self.gradients, f"G x {elems} = {g:g} B x {self.local_elements:,}"),
            (
                "optimizer state",
                self.optimizer_state,
                f"K x {elems} = {k:g} B x {self.local_elements:,} (AdamW: two fp32 moments)",
            ),
            ("model state", self.state, f"(P + G + K) x {elems}, {count}"),
        ]
        if n > 1 and not self.split_axis:
            rows.append(("gathered units", self.gathered_bytes, self.gathered_what))
            rows.append(("peak", self.peak, "model state + gathered units"))
        return rows

    def to_json(self) -> dict[str, Any]:
        """Plain data (bytes)."""
        return {
            "strategy": self.strategy,
            "shard_group": self.shard_group,
            "split_axis": self.split_axis,
            "param_elements": self.param_elements,
            "local_elements": self.local_elements,
            "bytes_per_element": {
                "parameters": self.param_bytes_per_element,
                "gradients": self.grad_bytes_per_element,
                "optimizer": self.optimizer_bytes_per_element,
            },
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "model_state": self.state,
            "gathered": self.gathered_bytes,
            "gathered_what": self.gathered_what,
            "peak": self.peak,
            "device_memory": self.device_memory_bytes,
        }


def estimate_memory(
    plan: ExecutionPlan,
    cluster: Cluster,
    groups: Groups | None = None,
    optimizer_bytes_per_param: float = ADAMW_BYTES_PER_PARAM,
) -> MemoryEstimate:
    """Per-rank model state of ``plan`` on ``cluster`` (see the module docstring)."""
    groups = groups or Groups(cluster)
    gathers = [n for n in plan.collectives() if n.kind == "gather"]
    device = cluster.device_memory_bytes
    stages = _stage_params(plan)
    if stages:
        return _pipeline_memory(plan, stages, optimizer_bytes_per_param, device)
    if gathers:
        return _sharded_memory(plan, groups, gathers, optimizer_bytes_per_param, device)
    grads = [
        n.collective
        for n in plan.collectives()
        if n.collective is not None
        and n.collective.op == "all_reduce"
        and n.phase == "backward"
        and _purpose(n) != "activation"
    ]
    activations = [n for n in plan.collectives() if _purpose(n) == "activation"]
    if not grads and activations:
        return _split_memory(plan, groups, activations, optimizer_bytes_per_param, device)
    if not grads:
        raise ConfigError(
            f"the {plan.strategy} plan has no gradient all-reduce and no parameter gather "
            f"(captured on {plan.world_size} rank(s)); capture it on 2 or more ranks"
        )
    psi = sum(s.numel for s in grads)
    elem = sum(s.numel * s.element_size for s in grads) / psi if psi else 0.0
    return MemoryEstimate(
        plan.strategy,
        1,
        psi,
        psi,
        elem,
        elem,
        optimizer_bytes_per_param,
        device_memory_bytes=device,
    )


def _sharded_memory(
    plan: ExecutionPlan,
    groups: Groups,
    gathers: list[PlanNode],
    k: float,
    device: int | None,
) -> MemoryEstimate:
    # one entry per unit: (numel, shard element size, gathered bytes, whole forward)
    units: dict[str, tuple[int, int, int, bool]] = {}
    scatter_size: dict[str, int] = {}
    for node in plan.collectives():
        if node.scatters_gradient and node.collective is not None:
            scatter_size[node.unit] = node.collective.element_size
    shard_group = 1
    for node in gathers:
        spec, gather = node.collective, node.facts(Gather)
        assert spec is not None and gather is not None
        unit = gather.unit
        shard_group = max(shard_group, groups.of(spec.axis).size)
        size = scatter_size.get(unit, spec.element_size)
        kept = gather.span == "whole_forward"
        old = units.get(unit)
        units[unit] = (spec.numel, size, spec.nbytes, kept or (old is not None and old[3]))
    psi = sum(n for n, _, _, _ in units.values())
    local = sum(-(-n // shard_group) for n, _, _, _ in units.values())
    elem = sum(n * s for n, s, _, _ in units.values()) / psi if psi else 0.0
    # gathered parameters + the full gradient (shard dtype) until its reduce-scatter
    held = {u: g + n * s for u, (n, s, g, _) in units.items()}
    whole = [u for u, v in units.items() if v[3]]
    others = [u for u in units if u not in whole]
    largest = max(others, key=lambda u: held[u], default=None)
    gathered = sum(held[u] for u in whole) + (held[largest] if largest else 0)
    parts = [f"{u} {format_bytes(held[u])}" for u in whole]
    if largest is not None:
        parts.append(f"largest other unit {largest} {format_bytes(held[largest])}")
    what = "gathered params + full grads: " + ", ".join(parts) if parts else ""
    return MemoryEstimate(
        plan.strategy, shard_group, psi, local, elem, elem, k, gathered, what, device
    )


def _purpose(node: PlanNode) -> str:
    facts = node.facts(Collective)
    return facts.purpose if facts is not None else ""


def _stage_params(plan: ExecutionPlan) -> dict[int, dict[int, int]]:
    """A pipelined plan's parameter elements per pipeline rank and stage (empty for other
    plans)."""
    held: dict[int, dict[int, int]] = {}
    for node in plan.nodes:
        detail = node.detail
        if isinstance(detail, Compute) and detail.rank is not None and detail.params is not None:
            held.setdefault(detail.rank, {})[detail.stage or 0] = detail.params
    return held


def _pipeline_memory(
    plan: ExecutionPlan,
    stages: dict[int, dict[int, int]],
    k: float,
    device: int | None,
) -> MemoryEstimate:
    """A pipeline: each rank holds its stages' parameters whole (fp32, as the plan's
    gradient all-reduces carry them); the largest rank's share, of the whole model (its
    wrap-time broadcast)."""
    whole = [
        n.collective
        for n in plan.collectives()
        if n.phase == "setup" and n.collective is not None and _purpose(n) == "broadcast"
    ]
    local = max(sum(held.values()) for held in stages.values())
    psi = sum(s.numel for s in whole) or sum(sum(h.values()) for h in stages.values())
    return MemoryEstimate(
        plan.strategy, len(stages), psi, local, 4, 4, k, 0, "", device,
        split_axis=pipeline_axis(plan), split_rule="the largest pipeline rank's stages",
    )  # fmt: skip


def _split_memory(
    plan: ExecutionPlan,
    groups: Groups,
    activations: list[PlanNode],
    k: float,
    device: int | None,
) -> MemoryEstimate:
    """Tensor parallelism alone: the whole model (the wrap-time broadcast) over tp."""
    state = [
        n.collective
        for n in plan.collectives()
        if n.phase == "setup" and n.collective is not None and _purpose(n) == "broadcast"
    ]
    if not state:
        raise ConfigError(
            f"the {plan.strategy} plan has no wrap-time broadcast to size the model by "
            f"(captured on {plan.world_size} rank(s)); capture it on 2 or more ranks"
        )
    spec = activations[0].collective
    assert spec is not None
    split = groups.of(spec.axis).size
    psi = sum(s.numel for s in state)
    elem = sum(s.numel * s.element_size for s in state) / psi if psi else 0.0
    local = -(-psi // split)
    return MemoryEstimate(
        plan.strategy, split, psi, local, elem, elem, k, 0, "", device, split_axis=spec.axis
    )


__all__ = ["ADAMW_BYTES_PER_PARAM", "MemoryEstimate", "estimate_memory"]
