"""The execution plan of a tensor-parallel step: :func:`build_tensor_plan`.

One collective node per activation collective the plan's layers issue in a step, each
on the ``tp`` axis with its bytes from the recorded forward: forward all-reduces out of
row-parallel linears and vocabulary-parallel embeddings (reduce-scatters with sequence
parallelism, and all-gathers into each region), the heads' logit all-gathers; backward
all-reduces of the gradients into column-parallel linears (all-gathers out of the
sequence-parallel regions and at the first block's sequence split) and of the
parameters on sequence slices (the row-parallel biases added there included) or met whole
by split activations (per-head norms). The
node ids are the functions below (:func:`forward_node`, ...): the layers issue their
collectives under the same ids (:mod:`.apply`), so the run log counts them by node.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from lamina.dtypes import dtype_from_name, dtype_name
from lamina.runtime import Collective, CollectiveSpec, Compute, ExecutionPlan, PlanNode
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.runtime.plan import meta_items
from lamina.runtime.render import LAYER_PLAN
from lamina.strategies.coalesced import dtype_totals
from lamina.strategies.tp.layers import TensorPlan

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


def forward_node(layer: str) -> str:
    """The forward collective out of ``layer`` (a row-parallel linear's sum or
    reduce-scatter, an embedding's sum, a head's logit gather)."""
    return f"tp.{layer}.fwd"


def backward_node(layer: str) -> str:
    """The backward collective of ``layer``: the input gradients of a region or head
    summed, or a reduce-scattering row-parallel linear's output gradient gathered."""
    return f"tp.{layer}.bwd"


def gather_node(layer: str) -> str:
    """The sequence gathered into ``layer`` (a region or a head; sequence parallelism)."""
    return f"tp.{layer}.gather"


def exit_node(region: str) -> str:
    """The output gradient of a region whose output is summed whole and then sliced on
    the sequence, gathered (sequence parallelism)."""
    return f"tp.{region}.exit"


def split_node(block: str) -> str:
    """The input gradient of the block where the sequence is split first, gathered
    (sequence parallelism)."""
    return f"tp.{block}.split"


def params_node(module: str) -> str:
    """The gradients of ``module``'s parameters summed: on sequence slices, or whole and
    met by activations split inside a region (per-head norms)."""
    return f"tp.{module}.params"


def bias_node(linear: str) -> str:
    """The gradient of a row-parallel linear's bias, added on sequence slices, summed."""
    return f"tp.{linear}.bias"


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
            forward_node(emb.module),
            "forward",
            "all_reduce",
            emb.output_shape,
            emb.dtype,
            emb.module,
            "vocabulary-parallel lookups summed",
        )
    if plan.sequence_parallel and plan.split_at and plan.regions:
        # the residual stream keeps its shape into the first region
        first = plan.regions[0]
        add(
            split_node(plan.split_at),
            "backward",
            "all_gather",
            first.input_shape,
            first.dtype,
            plan.split_at,
            "input gradient gathered where the sequence is split",
        )
    for region in plan.regions:
        name, dtype = region.module, region.dtype
        if plan.sequence_parallel:
            add(
                gather_node(name),
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
                forward_node(row.linear),
                "forward",
                op,
                shape,
                dtype,
                row.linear,
                "row-parallel partial outputs summed",
            )
            if op == "reduce_scatter":
                add(
                    backward_node(row.linear),
                    "backward",
                    "all_gather",
                    shape,
                    dtype,
                    row.linear,
                    "output gradient gathered",
                )
                bias: Any = getattr(model.get_submodule(row.linear), "bias", None)
                if isinstance(bias, nn.Parameter) and bias.requires_grad:
                    add(
                        bias_node(row.linear),
                        "backward",
                        "all_reduce",
                        tuple(bias.shape),
                        dtype_name(bias.dtype),
                        row.linear,
                        "gradient of the bias added on sequence slices summed",
                    )
        if plan.sequence_parallel and any(r.reduce == "sum" for r in region.rows):
            add(
                exit_node(name),
                "backward",
                "all_gather",
                region.output_shape,
                dtype,
                name,
                "output gradient gathered (the output is summed whole, then sliced)",
            )
        add(
            backward_node(name),
            "backward",
            "all_reduce",
            region.input_shape,
            dtype,
            name,
            "column-parallel input gradients summed",
        )
    for head in plan.heads:
        add(
            forward_node(head.module),
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
                gather_node(head.module),
                "forward",
                "all_gather",
                shape,
                head.dtype,
                head.module,
                "sequence gathered into the head",
            )
        add(
            backward_node(head.module),
            "backward",
            "all_reduce",
            shape,
            head.dtype,
            head.module,
            "input gradients summed",
        )
    summed = [(n, "on sequence slices") for n in plan.sequence_modules]
    summed += [(n, "met by split activations") for n, _ in plan.shared_modules]
    for name, why in summed:
        params = [p for p in model.get_submodule(name).parameters(recurse=False) if p.requires_grad]
        numel = sum(p.numel() for p in params)
        if numel:
            dtypes = {dtype_name(p.dtype) for p in params}
            add(
                params_node(name),
                "backward",
                "all_reduce",
                (numel,),
                dtypes.pop() if len(dtypes) == 1 else "float32",
                name,
                f"gradients of parameters {why} summed",
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
