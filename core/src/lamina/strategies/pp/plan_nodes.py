"""The execution plan of a pipelined step: :func:`build_pipeline_plan`.

The plan describes one pipeline, the same on every rank (each runs its own stages'
nodes): per stage and microbatch a forward and a backward, the activation it sends to
the next stage and the gradient it sends back (a ``send`` node paired with the peer's
``recv`` by an edge; peers are pipeline ranks, the position on the ``pp`` axis), then
per pipeline rank the all-reduce of its stages' gradients across the pipelines (the
other axes), the sum of a tied weight's gradient across the stages that hold it, and the
mean loss broadcast from the last stage's rank to its pipeline. Two adjacent stages on
one rank (ZBV's turn of the V) hand the activation and its gradient over in memory, as
torch's schedule does: no transfer node, an edge from one stage's node to the other's.
The engine records each node it runs by these ids (:func:`stage_node_id`,
:func:`average_id`, :func:`tied_id`, :data:`LOSS`) in the model's run log.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lamina.runtime import (
    Collective,
    CollectiveSpec,
    Compute,
    ExecutionPlan,
    PlanNode,
    Transfer,
)
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.runtime.plan import meta_items
from lamina.runtime.render import LAYER_PLAN
from lamina.strategies.pp.cut import StageCut
from lamina.strategies.pp.layout import PipelineLayout

OPTIMIZER = "optimizer"
#: The mean microbatch loss broadcast from the last stage's rank to its pipeline.
LOSS = "pp.loss"


def stage_node_id(stage: int, microbatch: int, what: str) -> str:
    """The id of stage ``stage``'s node ``what`` (``fwd``, ``bwd``, ``send_act``,
    ``recv_act``, ``send_grad``, ``recv_grad``) for ``microbatch``."""
    return f"pp.stage{stage}.mb{microbatch}.{what}"


def average_id(pipeline_rank: int) -> str:
    """The id of pipeline rank ``pipeline_rank``'s gradient all-reduce across pipelines."""
    return f"pp.grad.rank{pipeline_rank}"


def tied_id(name: str, gather_at: int | None = None) -> str:
    """The id of tied weight ``name``'s sum over its stages, or (``gather_at``: a pipeline
    rank) of that rank's gather of the pipelines' summed shares."""
    node = f"pp.tied.{name}"
    return node if gather_at is None else f"{node}.gather.rank{gather_at}"


def build_pipeline_plan(
    cut: StageCut,
    layout: PipelineLayout,
    microbatches: int,
    activations: Sequence[tuple[tuple[int, ...], str, int]],
    stage_params: Sequence[int],
    ties: Sequence[tuple[str, int, tuple[int, ...]]],
    setup: Sequence[tuple[str, int]],
    replica_axis: str,
    world: int,
    backend: str,
    lines: Sequence[str],
    pp_axis: str = "pp",
    replicas: int | None = None,
    setup_over: tuple[tuple[int, ...], str] | None = None,
) -> ExecutionPlan:
    """The plan (see the module). ``activations``: (shape per microbatch, dtype, element
    size) crossing each cut, in order; ``stage_params``: parameter elements per stage; ``ties``:
    (name, elements, stages holding it) of tied weights; ``setup``: the setup broadcast's
    elements by dtype; ``pp_axis``: the mesh axis the pipeline runs along; ``replicas``:
    the pipelines whose gradients pp averages (None: all of them; 1: none, a strategy
    composed on the other axes syncs them); ``setup_over``: the ranks (and their axes)
    the setup broadcast goes over (None: every rank)."""
    ranks, axes = setup_over or (tuple(range(world)), "world")
    nodes = broadcast_nodes("setup", setup, ranks, axes) if len(ranks) > 1 else []
    edges: list[tuple[str, str]] = []
    count = len(cut.spans)

    fid = stage_node_id

    for span in cut.spans:
        s = span.index
        rank = layout.holder(s)
        forward_s, backward_s = _split(cut.seconds[s])
        for m in range(microbatches):
            nodes.append(
                PlanNode(fid(s, m, "fwd"), "forward", "forward",
                         f"stage {s} forward, microbatch {m}",
                         Compute(stage=s, microbatch=m, rank=rank, seconds=forward_s,
                                 params=stage_params[s]))
            )  # fmt: skip
            nodes.append(
                PlanNode(fid(s, m, "bwd"), "backward", "backward",
                         f"stage {s} backward, microbatch {m}",
                         Compute(stage=s, microbatch=m, rank=rank, seconds=backward_s,
                                 params=stage_params[s]))
            )  # fmt: skip
            edges.append((fid(s, m, "fwd"), fid(s, m, "bwd")))
            if m:
                edges.append((fid(s, m - 1, "fwd"), fid(s, m, "fwd")))
            # a neighbour on this same rank takes the tensor in memory: no transfer
            after = s < count - 1 and layout.holder(s + 1) != rank
            before = s > 0 and layout.holder(s - 1) != rank
            transfers = []
            if after:
                transfers += [("send_act", "send", s + 1, "activation"),
                              ("recv_grad", "recv", s + 1, "gradient")]  # fmt: skip
            if before:
                transfers += [("recv_act", "recv", s - 1, "activation"),
                              ("send_grad", "send", s - 1, "gradient")]  # fmt: skip
            for what, kind, peer_stage, payload in transfers:
                peer = layout.holder(peer_stage)
                shape, dtype, size = activations[min(s, peer_stage)]
                numel = math.prod(shape)
                nodes.append(
                    PlanNode(
                        fid(s, m, what), kind, "forward" if payload == "activation" else "backward",
                        f"stage {s} {kind} {payload} of microbatch {m} "
                        f"{'to' if kind == 'send' else 'from'} stage {peer_stage}",
                        Transfer(peer, s, m, payload, dtype, numel, size, pp_axis),  # type: ignore[arg-type]
                    )
                )  # fmt: skip
            if after:
                edges += [(fid(s, m, "fwd"), fid(s, m, "send_act")),
                          (fid(s, m, "send_act"), fid(s + 1, m, "recv_act")),
                          (fid(s, m, "recv_grad"), fid(s, m, "bwd"))]  # fmt: skip
            elif s < count - 1:
                edges += [(fid(s, m, "fwd"), fid(s + 1, m, "fwd")),
                          (fid(s + 1, m, "bwd"), fid(s, m, "bwd"))]  # fmt: skip
            if before:
                edges += [(fid(s, m, "recv_act"), fid(s, m, "fwd")),
                          (fid(s, m, "bwd"), fid(s, m, "send_grad")),
                          (fid(s, m, "send_grad"), fid(s - 1, m, "recv_grad"))]  # fmt: skip
    nodes.append(
        PlanNode(OPTIMIZER, "optimizer", "step", "optimizer step (user's optimizer)", Compute())
    )
    replicas = len(layout.pipelines) if replicas is None else replicas
    for prank in range(layout.size):
        stages = layout.stages_of(prank)
        average = average_id(prank)
        if replicas > 1:
            # a weight two of the rank's stages hold (ZBV's tied embedding) goes once
            twice = sum(n * max(len(set(h) & set(stages)) - 1, 0) for _, n, h in ties)
            elements = sum(stage_params[s] for s in stages) - twice
            group = layout.replicas_at(prank)
            spec = CollectiveSpec("all_reduce", "float32", elements, 4, group, axis=replica_axis)
            about = f"stages {list(stages)}: mean gradient across {replicas} pipelines"
            nodes.append(PlanNode(average, "collective", "backward", about,
                                  Collective("gradient", params=elements), spec))  # fmt: skip
            edges += [(fid(s, microbatches - 1, "bwd"), average) for s in stages]
            edges.append((average, OPTIMIZER))
        for name, elements, holders in ties:
            ranks = tuple(sorted({layout.pipeline[layout.holder(s)] for s in holders}))
            if len(ranks) < 2 or layout.pipeline[prank] not in ranks:
                continue
            nodes += _tie_nodes(
                name, elements, holders, ranks, prank, layout, replica_axis, pp_axis, replicas
            )
            node = tied_id(name)
            first = prank == layout.holder(min(holders))
            if first:
                edges += [(fid(s, microbatches - 1, "bwd"), node) for s in holders]
                edges.append((node, OPTIMIZER))
            if replicas > 1:
                edges += [(average, node), (node, tied_id(name, prank))]
                edges.append((tied_id(name, prank), OPTIMIZER))
    for span in cut.spans:
        edges.append((fid(span.index, microbatches - 1, "bwd"), OPTIMIZER))
    last = count - 1
    if layout.size > 1:
        nodes.append(_loss_node(layout, pp_axis))
        edges.append((fid(last, microbatches - 1, "fwd"), LOSS))
    for setup_node in nodes:
        if setup_node.phase == "setup":
            edges.append((setup_node.id, fid(0, 0, "fwd")))
    return ExecutionPlan(
        strategy="pp",
        world_size=world,
        backend=backend,
        nodes=tuple(nodes),
        edges=tuple(edges),
        meta=(
            *meta_items(
                pp=layout.size,
                stages=count,
                schedule=layout.schedule.name,
                microbatches=microbatches,
            ),
            (LAYER_PLAN, "\n".join(lines)),
        ),
        replicate_axis=replica_axis if replicas > 1 else "",
    )


def _split(seconds: float) -> tuple[float, float]:
    """A stage's measured forward + backward of one microbatch as (forward, backward),
    the backward twice the forward (as the schedules' bubble formulas assume; the cut
    times the two together), rounded so every rank writes the same plan."""
    return round(seconds / 3, 9), round(2 * seconds / 3, 9)


def _tie_nodes(
    name: str,
    elements: int,
    holders: tuple[int, ...],
    ranks: tuple[int, ...],
    prank: int,
    layout: PipelineLayout,
    replica_axis: str,
    pp_axis: str,
    replicas: int,
) -> list[PlanNode]:
    """A tied weight's gradient sum over the stages holding it (one node, at its first
    holder), and with R pipelines each holder's gather of the R shares the pipelines
    summed (the engine's ``_sum_tied``)."""
    share = -(-elements // replicas)
    node = tied_id(name)
    out = []
    if prank == layout.holder(min(holders)):
        spec = CollectiveSpec("all_reduce", "float32", share, 4, ranks, axis=pp_axis)
        part = f" (1/{replicas} per pipeline)" if replicas > 1 else ""
        about = f"{name}: tied weight's gradient summed over stages {list(holders)}{part}"
        out.append(PlanNode(node, "collective", "backward", about,
                            Collective("gradient", params=1, layer=name), spec))  # fmt: skip
    if replicas > 1:
        group = layout.replicas_at(prank)
        gathered = share * replicas
        spec = CollectiveSpec("all_gather", "float32", gathered, 4, group, axis=replica_axis)
        about = f"{name}: the {replicas} pipelines' summed shares gathered"
        out.append(PlanNode(tied_id(name, prank), "collective", "backward", about,
                            Collective("gradient", params=1, layer=name), spec))  # fmt: skip
    return out


def _loss_node(layout: PipelineLayout, pp_axis: str) -> PlanNode:
    """The mean microbatch loss (one float32) broadcast from the rank holding the last
    stage to the others of its pipeline, so that ``model.step`` returns it on each."""
    source = layout.pipeline[layout.holder(layout.stage_count - 1)]
    spec = CollectiveSpec("broadcast", "float32", 1, 4, layout.pipeline, axis=pp_axis)
    about = "the step's mean microbatch loss, from the last stage's rank to the pipeline"
    return PlanNode(LOSS, "collective", "backward", about,
                    Collective("broadcast", source=source), spec)  # fmt: skip
