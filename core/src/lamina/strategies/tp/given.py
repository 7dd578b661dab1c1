"""A tensor-parallel plan given as torch's own ``ParallelStyle`` objects by module name
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``:
a torchtitan plan unchanged), applied as torch applies it.

The derivation (:func:`.derive.derive_plan` with ``given``) follows the recorded forward
splitting only the layers the styles name; this module holds what it asks of the
styles: that they name real modules (:func:`check_styles`), the role each linear takes
(:func:`given_role`: a one-line ConfigError where the plan cannot run, such as a
row-parallel layer whose input is not split), the plan's layers as the styles set them
(:func:`given_layers`), and how the styles differ from the derived plan
(:func:`differences`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
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
from lamina.strategies.tp.layers import Region, Row, TensorPlan
from lamina.strategies.tp.styles import style_key, torch_styles

#: The styles a given plan may hold.
STYLES: tuple[type[ParallelStyle], ...] = (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    PrepareModuleInput,
)


def wants_sequence_parallel(styles: Mapping[str, ParallelStyle]) -> bool:
    """Whether the given plan splits activations on the sequence (dim 1) between regions
    (a ``SequenceParallel`` on the heads dim, as for q/k norms, does not)."""
    return any(
        isinstance(s, SequenceParallel) and _layouts(s, "sequence_sharding") == (Shard(1),)
        for s in styles.values()
    )


def check_styles(styles: Mapping[str, ParallelStyle], model: nn.Module) -> None:
    """A one-line ConfigError for an entry that is no known style or names no module."""
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


def given_role(
    styles: Mapping[str, ParallelStyle], linear: str, split_input: bool, origin: str
) -> None:
    """Check the style of ``linear`` against its input: split on its features by the
    column-parallel layers ``origin`` (``split_input``) or whole."""
    style = styles.get(linear)
    if isinstance(style, ColwiseParallel) and split_input:
        raise ConfigError(
            f"the given tensor-parallel plan makes {linear} a ColwiseParallel, but its input "
            f"is already split by {origin}; make {linear} a RowwiseParallel"
        )
    if isinstance(style, RowwiseParallel) and not split_input:
        raise ConfigError(
            f"the given tensor-parallel plan makes {linear} a RowwiseParallel, but its input "
            "is not split on its features (no ColwiseParallel layer feeds it); split the "
            f"layer before it with ColwiseParallel, or leave {linear} out of the plan"
        )
    if style is None and split_input:
        raise ConfigError(
            f"{linear} takes the split output of {origin}, but the given tensor-parallel "
            f"plan gives it no style; make it a RowwiseParallel, or leave {origin} out"
        )


def given_layers(
    plan: TensorPlan, styles: Mapping[str, ParallelStyle], model: nn.Module
) -> TensorPlan:
    """``plan`` (followed with only the styled layers split) as the styles set it: a
    one-line ConfigError for a styled layer that cannot be split."""
    why = dict(plan.replicated)
    for name, style in styles.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and name in why:
            raise ConfigError(
                f"the given tensor-parallel plan splits {name} ({type(style).__name__}), but "
                f"it cannot be split: {why[name]}; leave it out of the plan"
            )
    embeddings = tuple(
        e for e in plan.embeddings if isinstance(styles.get(e.module), RowwiseParallel)
    )
    vocab = {e.module for e in embeddings} | {h.module for h in plan.heads}
    linears = {n for r in plan.regions for n in r.linears()}
    for name, style in styles.items():
        kind = nn.Embedding if isinstance(style, RowwiseParallel) else nn.Linear
        module = model.get_submodule(name)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and name not in linears | vocab:
            raise ConfigError(
                f"the given tensor-parallel plan splits {name} ({type(style).__name__}), but "
                f"the recorded forward shows no split for a {type(module).__name__} there "
                f"(a {kind.__name__} looked up by the model's input, or a linear); leave it "
                "out of the plan"
            )
    return replace(
        plan,
        regions=tuple(_rows_as_given(r, styles) for r in plan.regions),
        embeddings=embeddings,
        replicated=tuple((n, w) for n, w in plan.replicated if n not in styles),
    )


def _rows_as_given(region: Region, styles: Mapping[str, ParallelStyle]) -> Region:
    rows = []
    for row in region.rows:
        scatter = Shard(1) in _layouts(styles[row.linear], "output_layouts")
        rows.append(Row(row.linear, "scatter" if scatter else row.reduce))
    return replace(region, rows=tuple(rows))


def differences(styles: Mapping[str, ParallelStyle], derived: TensorPlan | str) -> tuple[str, ...]:
    """How ``styles`` differ from the ``derived`` plan (its refusal, when the derivation
    refused), one line each."""
    if isinstance(derived, str):
        return (f"the derivation refuses this model: {derived}",)
    ours = torch_styles(derived)
    why = dict(derived.replicated)
    out = []
    for name in sorted(set(styles) | set(ours)):
        given, derived_style = styles.get(name), ours.get(name)
        if derived_style is None and given is not None:
            reason = why.get(name, "not split")
            out.append(f"{name}: given {_describe(given)}, derived whole ({reason})")
        elif given is None and derived_style is not None:
            out.append(f"{name}: given whole, derived {_describe(derived_style)}")
        elif (
            given is not None
            and derived_style is not None
            and style_key(given) != style_key(derived_style)
        ):
            out.append(f"{name}: given {_describe(given)}, derived {_describe(derived_style)}")
    return tuple(out)


def _describe(style: ParallelStyle) -> str:
    key = style_key(style)
    fields = ("input", "output", "desired input", "local output", "sequence", "kw in", "kw want")
    set_fields = [f"{f}={v}" for f, v in zip(fields, key[1:], strict=True) if v != "None"]
    return f"{key[0]}({', '.join(set_fields)})"


def _layouts(style: ParallelStyle, attr: str) -> tuple[Any, ...]:
    value = getattr(style, attr, ())
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
