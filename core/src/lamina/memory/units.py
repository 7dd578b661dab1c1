"""Parameter units from the module structure: what is gathered and freed together.

A unit is a group of parameters that ZeRO-3 keeps in one flat buffer: all-gathered
before the unit's forward, freed after it. By default each block of the model's block
container (the transformer blocks, the MLP layers) is one unit, and every other
parameter (embeddings, final norm, head) goes to the root unit. ZeRO-3 passes the blocks
:func:`lamina.graph.blocks.unit_blocks` finds (an ``nn.ModuleList``, ``nn.Sequential``,
``nn.ModuleDict`` or custom container of blocks); called without them, the children of
the first ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` are taken (this layer
cannot import the graph layer). Frozen parameters
(``requires_grad=False``) are sharded too, as FSDP2 shards them: a frozen base model
takes 1/N of its memory per rank, like a trained one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lamina.errors import ConfigError

#: Name of the unit holding the parameters that belong to no block.
ROOT_UNIT = "(root)"

#: Default threshold below which block units are merged with their neighbours.
DEFAULT_MIN_UNIT_NUMEL = 1 << 16


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def unit_modules(
    model: nn.Module,
    unit_types: tuple[type[nn.Module], ...] | None = None,
    blocks: Sequence[str] | None = None,
) -> list[str]:
    """Qualified names of the modules that become units (before merging small ones).

    With ``unit_types``: every outermost submodule of those types (the model itself
    excluded: the root unit covers it). Else ``blocks`` when given (ZeRO-3's:
    :func:`lamina.graph.blocks.unit_blocks`). Else the children with parameters of the
    first ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` (in
    ``named_modules()`` order, the model itself included) that has such children; none if
    there is no container.
    """
    if unit_types is not None:
        chosen: list[str] = []
        for name, module in model.named_modules():
            if not name or not isinstance(module, unit_types):
                continue
            if any(name.startswith(c + ".") for c in chosen):
                continue  # nested inside a unit already chosen
            chosen.append(name)
        return chosen
    if blocks is not None:
        return list(blocks)
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            children = [_join(name, c) for c, m in module.named_children() if _has_parameters(m)]
            if children:
                return children
    return []


def _owner(param_name: str, unit_set: set[str]) -> str | None:
    parts = param_name.split(".")
    for i in range(1, len(parts)):
        candidate = ".".join(parts[:i])
        if candidate in unit_set:
            return candidate
    return None


def _merged_name(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def _merge_small(
    blocks: list[tuple[str, list[str], int]], min_unit_numel: int
) -> list[tuple[str, list[str]]]:
    """Greedy merge in order: a group closes once it holds ``min_unit_numel`` elements;
    a small group left at the end joins the group before it (if there is one)."""
    groups: list[tuple[list[str], list[str]]] = []
    names: list[str] = []
    params: list[str] = []
    numel = 0
    for name, members, size in blocks:
        names.append(name)
        params.extend(members)
        numel += size
        if numel >= min_unit_numel:
            groups.append((names, params))
            names, params, numel = [], [], 0
    if names:
        if groups:
            groups[-1][0].extend(names)
            groups[-1][1].extend(params)
        else:
            groups.append((names, params))
    return [(_merged_name(n), p) for n, p in groups]


def group_units(
    model: nn.Module,
    *,
    min_unit_numel: int = DEFAULT_MIN_UNIT_NUMEL,
    unit_types: tuple[type[nn.Module], ...] | None = None,
    blocks: Sequence[str] | None = None,
) -> list[tuple[str, list[str]]]:
    """Group ``model``'s parameters into units: ``[(unit name, [param names])]``.

    Units come from :func:`unit_modules` (``unit_types``, else ``blocks``); parameters
    outside them form ``"(root)"``. Block units under ``min_unit_numel`` elements are merged
    forward with the blocks after them until the group reaches the threshold; a small group
    left at the end joins the group before it. A merged unit is named ``"first..last"``
    (e.g. ``"blocks.0..blocks.2"``). The root unit is never merged: it holds parameters used
    at both ends of the forward (embeddings, final norm, head). Tied parameters appear once,
    under the name ``named_parameters()`` keeps; frozen parameters (``requires_grad=False``)
    are grouped like the others. Parameters keep ``named_parameters()`` order within a unit,
    and units are ordered by their first parameter.
    """
    if min_unit_numel < 0:
        raise ConfigError(f"min_unit_numel must be >= 0, got {min_unit_numel}")
    every = list(model.named_parameters())
    position = {name: i for i, (name, _) in enumerate(every)}
    modules = unit_modules(model, unit_types, blocks)
    members: dict[str, list[str]] = {m: [] for m in modules}
    sizes: dict[str, int] = dict.fromkeys(modules, 0)
    root: list[str] = []
    unit_set = set(modules)
    for name, param in every:
        owner = _owner(name, unit_set)
        if owner is None:
            root.append(name)
        else:
            members[owner].append(name)
            sizes[owner] += param.numel()
    held = [(m, members[m], sizes[m]) for m in modules if members[m]]
    held.sort(key=lambda b: position[b[1][0]])
    units = _merge_small(held, min_unit_numel)
    if root:
        units.append((ROOT_UNIT, root))
    units.sort(key=lambda u: position[u[1][0]])
    return units


def check_units(
    model: nn.Module, units: Sequence[tuple[str, Sequence[str]]]
) -> list[tuple[str, list[str]]]:
    """``units`` as lists, after checking that every name is a parameter of ``model``
    (not a tied alias) and that no parameter is in two units."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    every = dict(model.named_parameters(remove_duplicate=False))
    unknown = [n for _, names in units for n in names if n not in every]
    if unknown:
        raise ConfigError(
            f"units name parameters the model does not have: {unknown[:5]}; "
            "use names from model.named_parameters()"
        )
    owner: dict[str, str] = {}
    for unit, names in units:
        for n in names:
            first = canonical[id(every[n])]
            if first != n:
                raise ConfigError(
                    f"unit {unit!r} names {n!r}, a tied alias of {first!r}; use {first!r}"
                )
            if n in owner:
                raise ConfigError(
                    f"parameter {n!r} is in two units ({owner[n]!r} and {unit!r}); "
                    "put each parameter in one unit"
                )
            owner[n] = unit
    return [(unit, list(names)) for unit, names in units]
