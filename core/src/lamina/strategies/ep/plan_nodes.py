"""The execution plan of an expert-parallel step: :func:`build_expert_plan`.

Per MoE layer ``i`` (:class:`~.dispatch.DispatchNodes`): forward, the assignment counts'
all-to-all (``moe.i.counts``), the tokens' (``moe.i.tokens``) and the results'
(``moe.i.results``); backward, the results' gradients going back to the experts
(``moe.i.results_grad``) and the tokens' gradients to their ranks (``moe.i.tokens_grad``).
The token exchanges are sized from the routing measured on the example batch (the mean
rank's exchange with the others), or for an even routing (each rank its ``tokens x k``
assignments); what a step really moves follows the router and is what the run log
records. With a global load-balancing loss, one all-reduce of the assignment counts
over the data replicas (``moe.aux_counts``). After backward, the dense gradients are
averaged over the ep axis and the replica axes (``gradients.dense.<dtype>``) and the
experts' over the replica axes (``gradients.experts.<dtype>``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.dtypes import dtype_from_name, dtype_name
from lamina.runtime import Collective, CollectiveSpec, Compute, ExecutionPlan, PlanNode
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.runtime.nodes import CollectivePurpose
from lamina.runtime.plan import meta_items
from lamina.runtime.render import EXPERT_AXIS
from lamina.strategies.ep.aux_loss import AUX_NODE
from lamina.strategies.ep.dispatch import DispatchNodes
from lamina.strategies.ep.find import MoeLayer
from lamina.strategies.ep.grad_sync import dense_node, expert_node

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


@dataclass(frozen=True)
class PlanGroup:
    """A group the plan names: its global ranks and mesh axes label."""

    ranks: tuple[int, ...]
    axis: str

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ExpertPlanInput:
    """What the plan is built from (see :func:`build_expert_plan`)."""

    layers: tuple[MoeLayer, ...]
    ep: PlanGroup
    #: Dense gradients' group (ep and replica axes) and the experts' (replica axes).
    dense: PlanGroup
    replicas: PlanGroup
    #: The load-balancing loss's group (None: no global loss).
    balance: PlanGroup | None
    #: Trainable elements per dtype name: dense, experts (this rank's, before a sharder).
    dense_numel: dict[str, int]
    expert_numel: dict[str, int]
    #: The whole model's state per dtype for the setup broadcast (empty: none).
    setup: tuple[tuple[str, int], ...]
    world: int
    backend: str
    #: Shards a later sharder cuts each gradient into (1: none).
    sharded: int = 1
    #: Per layer, the assignments a rank's token exchange is sized for (the mean rank's
    #: off-rank share of the measured routing as a whole exchange; absent: an even
    #: routing).
    exchanged: tuple[int, ...] = ()


def build_expert_plan(
    given: ExpertPlanInput, meta: tuple[tuple[str, str], ...] = ()
) -> ExecutionPlan:
    """The step's plan (see the module)."""
    nodes = broadcast_nodes("setup", given.setup, tuple(range(given.world))) if given.setup else []
    nodes += [
        PlanNode(FORWARD, "forward", "forward", "forward (expert parallel)", Compute()),
        PlanNode(BACKWARD, "backward", "backward", "backward (autograd)", Compute()),
    ]

    def collective(
        node_id: str, phase: str, op: str, numel: int, dtype: str, what: str, on: PlanGroup
    ) -> None:
        spec = CollectiveSpec(
            op, dtype, numel, dtype_from_name(dtype).itemsize, on.ranks, axis=on.axis
        )
        purpose: CollectivePurpose = (
            "gradient" if node_id.startswith("gradients.") else "activation"
        )
        nodes.append(
            PlanNode(node_id, "collective", phase, what, Collective(purpose, layer=what), spec)
        )

    ep = given.ep
    if ep.size > 1:
        for index, layer in enumerate(given.layers):
            ids = DispatchNodes(index)
            assignments = given.exchanged[index] if given.exchanged else layer.tokens * layer.top_k
            rows = assignments * layer.hidden
            dtype = dtype_name(layer.dtype)
            what = f"MoE layer {index} ({layer.name})"
            collective(
                ids.counts,
                FORWARD,
                "all_to_all",
                layer.experts + ep.size,
                "int64",
                what + ": counts",
                ep,
            )
            collective(ids.tokens, FORWARD, "all_to_all", rows, dtype, what + ": tokens", ep)
            collective(ids.results, FORWARD, "all_to_all", rows, dtype, what + ": results", ep)
            collective(
                ids.results_grad,
                BACKWARD,
                "all_to_all",
                rows,
                dtype,
                what + ": results' gradients",
                ep,
            )
            collective(
                ids.tokens_grad,
                BACKWARD,
                "all_to_all",
                rows,
                dtype,
                what + ": tokens' gradients",
                ep,
            )
    balance = given.balance
    if balance is not None and balance.size > 1 and given.layers:
        experts = given.layers[0].experts
        collective(
            AUX_NODE,
            FORWARD,
            "all_reduce",
            experts + 1,
            "float32",
            "load-balancing loss: assignment counts over the data replicas",
            balance,
        )
    for group, numels, node, what in (
        (given.dense, given.dense_numel, dense_node, "dense gradients averaged"),
        (given.replicas, given.expert_numel, expert_node, "expert gradients averaged"),
    ):
        if group.size > 1:
            for dtype, numel in sorted(numels.items()):
                shard = -(-numel // given.sharded)
                collective(
                    node(dtype), BACKWARD, "all_reduce", shard, dtype, f"{dtype} {what}", group
                )
    nodes.append(
        PlanNode(OPTIMIZER, "optimizer", "step", "optimizer step (user's optimizer)", Compute())
    )
    edges = [(FORWARD, BACKWARD)]
    for node_ in nodes:
        if node_.phase == "setup":
            edges.append((node_.id, FORWARD))
        elif node_.kind == "collective":
            if node_.phase == FORWARD:
                edges += [(FORWARD, node_.id), (node_.id, BACKWARD)]
            else:
                edges += [(BACKWARD, node_.id), (node_.id, OPTIMIZER)]
    edges.append((BACKWARD, OPTIMIZER))
    return ExecutionPlan(
        strategy="ep",
        world_size=given.world,
        backend=given.backend,
        nodes=tuple(nodes),
        edges=tuple(edges),
        meta=(*meta_items(ep=ep.size, moe_layers=len(given.layers)), (EXPERT_AXIS, ep.axis), *meta),
    )


__all__ = ["ExpertPlanInput", "PlanGroup", "build_expert_plan"]
