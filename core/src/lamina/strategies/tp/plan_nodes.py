"""The execution plan of a tensor-parallel step: :func:`build_tensor_plan`.

One collective node per activation collective the plan's layers issue in a step, each
on the ``tp`` axis with its bytes from the recorded forward: forward all-reduces out of
row-parallel linears and vocabulary-parallel embeddings (reduce-scatters with sequence
parallelism, and all-gathers into each region), the heads' logit all-gathers; backward
all-reduces of the gradients into column-parallel linears (all-gathers out of the
sequence-parallel regions) and of the parameters on sequence slices.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from lamina.dtypes import dtype_from_name
from lamina.runtime import Collective, CollectiveSpec, Compute, ExecutionPlan, PlanNode
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.runtime.plan import meta_items
from lamina.runtime.render import LAYER_PLAN
from lamina.strategies.coalesced import dtype_totals
from lamina.strategies.tp.layers import TensorPlan

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


def build_tensor_plan(
    plan: TensorPlan,
    model: nn.Module,
    group: tuple[int, ...],
    axis: str,
    world: int,
    backend: str,
) -> ExecutionPlan:
    """The step's plan over this rank's tensor-parallel ``group`` on ``axis``."""
    state = dtype_totals([t for t in (*model.parameters(), *model.buffers()) if not t.is_meta])
    nodes = broadcast_nodes("setup", state, tuple(range(world)), "world") if world > 1 else []
    nodes += [
        PlanNode(FORWARD, "forward", "forward", f"forward ({plan.source})", Compute()),
        PlanNode(BACKWARD, "backward", "backward", "backward (autograd)", Compute()),
    ]

    def add(
        node_id: str, phase: str, op: str, shape: tuple[int, ...], dtype: str, layer: str, what: str
    ) -> None:
        numel = math.prod(shape)
        spec = CollectiveSpec(op, dtype, numel, dtype_from_name(dtype).itemsize, group, axis=axis)
        nodes.append(
            PlanNode(
                node_id,
                "collective",
                phase,
                f"{layer}: {what}",
                Collective("activation", layer=layer),
                spec,
            )
        )

    for emb in plan.embeddings:
        add(
            f"tp.{emb.module}.fwd",
            "forward",
            "all_reduce",
            emb.output_shape,
            emb.dtype,
            emb.module,
            "vocabulary-parallel lookups summed",
        )
    for region in plan.regions:
        name, dtype = region.module, region.dtype
        if plan.sequence_parallel:
            add(
                f"tp.{name}.gather",
                "forward",
                "all_gather",
                region.input_shape,
                dtype,
                name,
                "sequence gathered into the region",
            )
        for row in region.rows:
            shape = region.output_shape
            op = (
                "reduce_scatter"
                if plan.sequence_parallel and row.reduce == "scatter"
                else "all_reduce"
            )
            add(
                f"tp.{row.linear}.fwd",
                "forward",
                op,
                shape,
                dtype,
                row.linear,
                "row-parallel partial outputs summed",
            )
            if op == "reduce_scatter":
                add(
                    f"tp.{row.linear}.bwd",
                    "backward",
                    "all_gather",
                    shape,
                    dtype,
                    row.linear,
                    "output gradient gathered",
                )
        add(
            f"tp.{name}.bwd",
            "backward",
            "all_reduce",
            region.input_shape,
            dtype,
            name,
            "column-parallel input gradients summed",
        )
    for head in plan.heads:
        add(
            f"tp.{head.module}.fwd",
            "forward",
            "all_gather",
            head.output_shape,
            head.dtype,
            head.module,
            "vocabulary-parallel logits gathered",
        )
        weight: Any = model.get_submodule(head.module).weight
        width = int(weight.shape[-1])
        shape = (*head.output_shape[:-1], width)
        if plan.sequence_parallel:
            add(
                f"tp.{head.module}.gather",
                "forward",
                "all_gather",
                shape,
                head.dtype,
                head.module,
                "sequence gathered into the head",
            )
        add(
            f"tp.{head.module}.bwd",
            "backward",
            "all_reduce",
            shape,
            head.dtype,
            head.module,
            "input gradients summed",
        )
    for name in plan.sequence_modules:
        params = [p for p in model.get_submodule(name).parameters(recurse=False) if p.requires_grad]
        numel = sum(p.numel() for p in params)
        if numel:
            add(
                f"tp.{name}.params",
                "backward",
                "all_reduce",
                (numel,),
                "float32",
                name,
                "gradients of parameters on sequence slices summed",
            )
    nodes.append(
        PlanNode(OPTIMIZER, "optimizer", "step", "optimizer step (user's optimizer)", Compute())
    )
    edges = [(FORWARD, BACKWARD)]
    for node in nodes:
        if node.phase == "setup":
            edges.append((node.id, FORWARD))
        elif node.kind == "collective":
            edges.append((FORWARD, node.id) if node.phase == "forward" else (BACKWARD, node.id))
            edges.append((node.id, OPTIMIZER) if node.phase == "backward" else (node.id, BACKWARD))
    edges.append((BACKWARD, OPTIMIZER))
    return ExecutionPlan(
        strategy="tp",
        world_size=world,
        backend=backend,
        nodes=tuple(nodes),
        edges=tuple(edges),
        meta=(
            *meta_items(tp=plan.size, sequence_parallel=plan.sequence_parallel),
            (LAYER_PLAN, "\n".join(plan.lines())),
        ),
    )
