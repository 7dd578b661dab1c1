"""A tensor-parallel plan given as torch's own ``ParallelStyle`` objects by module name
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``: a torchtitan plan unchanged): :func:`plan_from_styles`.

The given styles decide which layer is split how; the recorded forward supplies what
they leave implicit (fused projections' chunks, head counts, activation shapes, where
the sequence is first split) and checks them: a split the graph cannot run (a region
given only in part, a style on a module of the wrong kind) is a one-line ConfigError
naming the module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lamina.errors import ConfigError
from lamina.strategies.tp.layers import Region, Row, TensorPlan, VocabLayer

#: The styles a given plan may hold.
STYLES: tuple[type[ParallelStyle], ...] = (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    PrepareModuleInput,
)


def wants_sequence_parallel(styles: Mapping[str, ParallelStyle]) -> bool:
    """Whether the given plan splits activations on the sequence between regions."""
    return any(isinstance(s, SequenceParallel) for s in styles.values())


def plan_from_styles(
    styles: Mapping[str, ParallelStyle], derived: TensorPlan, model: nn.Module
) -> TensorPlan:
    """The plan ``styles`` give, filled in and checked against ``derived`` (the plan
    derived from the same forward, with sequence parallelism as ``styles`` want)."""
    _check_styles(styles, model)
    regions = tuple(_given_region(region, styles) for region in derived.regions)
    kept = tuple(r for r in regions if r is not None)
    linears = {n for r in derived.regions for n in (*r.linears(),)}
    embeddings = _given_vocab(derived.embeddings, styles, RowwiseParallel, model, nn.Embedding)
    heads = _given_vocab(derived.heads, styles, ColwiseParallel, model, nn.Linear)
    known = linears | {v.module for v in (*derived.embeddings, *derived.heads)}
    for name, style in styles.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and name not in known:
            why = dict(derived.replicated).get(name, "the recorded forward shows no split for it")
            raise ConfigError(
                f"the given tensor-parallel plan splits {name} ({type(style).__name__}), but "
                f"it cannot be split: {why}; leave it out of the plan"
            )
    sequence = wants_sequence_parallel(styles)
    # every module the slices meet has its gradients summed, named by the plan or not
    # (a router on the slices is no SequenceParallel entry in a torchtitan plan)
    modules = derived.sequence_modules
    return TensorPlan(
        derived.size,
        kept,
        embeddings,
        heads,
        sequence and derived.sequence_parallel,
        derived.split_at if sequence else "",
        modules if sequence else (),
        derived.replicated,
        "given as torch ParallelStyle objects",
        split_at_embedding=derived.split_at_embedding,
    )


def _check_styles(styles: Mapping[str, ParallelStyle], model: nn.Module) -> None:
    for name, style in styles.items():
        if not isinstance(style, STYLES):
            raise ConfigError(
                f"tensor-parallel plan entry {name!r} is a {type(style).__name__}; give one of "
                f"{', '.join(s.__name__ for s in STYLES)}"
            )
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ConfigError(
                f"tensor-parallel plan names module {name!r}, which {type(model).__name__} "
                "does not have; use the names model.named_modules() gives"
            ) from None


def _given_region(region: Region, styles: Mapping[str, ParallelStyle]) -> Region | None:
    """``region`` as the styles split it (None: left replicated)."""
    names = region.linears()
    given = [n for n in names if n in styles]
    if not given:
        return None
    if len(given) != len(names):
        missing = [n for n in names if n not in styles]
        raise ConfigError(
            f"the given tensor-parallel plan splits part of {region.module} but not "
            f"{', '.join(missing)}; give every linear of the region a style, or none"
        )
    for column in region.columns:
        _expect(styles[column.linear], ColwiseParallel, column.linear, "column")
    rows = []
    for row in region.rows:
        style = _expect(styles[row.linear], RowwiseParallel, row.linear, "row")
        scatter = any(isinstance(p, Shard) for p in _layouts(style, "output_layouts"))
        rows.append(Row(row.linear, "scatter" if scatter else "sum"))
    return Region(
        region.module,
        region.columns,
        tuple(rows),
        region.entry,
        region.input_shape,
        region.output_shape,
        region.dtype,
    )


def _given_vocab(
    layers: tuple[VocabLayer, ...],
    styles: Mapping[str, ParallelStyle],
    kind: type[ParallelStyle],
    model: nn.Module,
    module_kind: type[nn.Module],
) -> tuple[VocabLayer, ...]:
    kept = []
    for layer in layers:
        style = styles.get(layer.module)
        if style is None:
            continue
        _expect(style, kind, layer.module, "vocabulary")
        if not isinstance(model.get_submodule(layer.module), module_kind):
            raise ConfigError(f"{layer.module} is not a {module_kind.__name__}")
        kept.append(layer)
    return tuple(kept)


def _expect(style: ParallelStyle, kind: type[ParallelStyle], name: str, role: str) -> Any:
    if not isinstance(style, kind):
        raise ConfigError(
            f"the given tensor-parallel plan makes {name} a {type(style).__name__}, but the "
            f"recorded forward makes it a {role}-parallel layer ({kind.__name__}); fix its style"
        )
    return style


def _layouts(style: ParallelStyle, attr: str) -> tuple[Any, ...]:
    value = getattr(style, attr, ())
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
