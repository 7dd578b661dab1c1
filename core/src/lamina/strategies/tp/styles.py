"""A :class:`~.layers.TensorPlan` as torch's own ``ParallelStyle`` objects, by module name:
:func:`torch_styles`, the plan a torchtitan-style ``parallelize_module`` call takes.

Used to compare a derived plan with a hand-written one and to run torch's own tensor
parallelism with lamina's plan (the benchmark's baseline).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lamina.strategies.tp.layers import TensorPlan


def torch_styles(plan: TensorPlan) -> dict[str, ParallelStyle]:
    """Module name -> the ``ParallelStyle`` that splits it as ``plan`` does."""
    sp = plan.sequence_parallel
    between = Shard(plan.seq_dim) if sp else Replicate()
    styles: dict[str, ParallelStyle] = {}
    sliced_by_embedding = sp and plan.split_at_embedding
    for emb in plan.embeddings:
        out = between if sliced_by_embedding else Replicate()
        styles[emb.module] = RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    if sp and not sliced_by_embedding:  # something is added first (learned positions)
        styles[plan.split_at] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(between,), use_local_output=True
        )
    for region in plan.regions:
        gathered = sp and not region.owned  # no module of its own: each column gathers
        if sp and region.owned and isinstance(region.entry, str):
            styles[region.module] = PrepareModuleInput(
                input_kwarg_layouts={region.entry: between},
                desired_input_kwarg_layouts={region.entry: Replicate()},
            )
        elif sp and region.owned:
            given: list[Placement | None] = [None] * region.positional
            wanted: list[Placement | None] = [None] * region.positional
            given[int(region.entry)], wanted[int(region.entry)] = between, Replicate()
            styles[region.module] = PrepareModuleInput(
                input_layouts=tuple(given), desired_input_layouts=tuple(wanted)
            )
        for column in region.columns:
            styles[column.linear] = (
                ColwiseParallel(input_layouts=between) if gathered else ColwiseParallel()
            )
        for row in region.rows:
            out = between if row.reduce == "scatter" else Replicate()
            styles[row.linear] = RowwiseParallel(output_layouts=out)
    for name in plan.sequence_modules:
        styles[name] = SequenceParallel()
    for name, dim in plan.shared_modules:  # whole weights on inputs split by heads
        styles[name] = SequenceParallel(sequence_dim=dim, use_local_output=True)
    for head in plan.heads:
        styles[head.module] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    return styles


def style_key(style: ParallelStyle) -> tuple[Any, ...]:
    """What makes two styles the same split: the class and its layouts."""
    fields = (
        "input_layouts",
        "output_layouts",
        "desired_input_layouts",
        "use_local_output",
        "sequence_sharding",
        "input_kwarg_layouts",
        "desired_input_kwarg_layouts",
    )
    return (type(style).__name__, *(repr(getattr(style, f, None)) for f in fields))
