"""The two graph-tracing capture paths: ``torch.export`` (non-strict) and ``torch.fx``.

Each returns a :class:`PathResult`: the graph's nodes and the position of each trainable
parameter's first use (canonical names from :class:`~lamina.graph.params.ParamTable`).
The module-hook path lives in :mod:`lamina.graph.hook_trace`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lamina.graph.metadata import NodeInfo, op_target, qualified_name, tensor_meta
from lamina.graph.params import ParamTable

# torch logs a whole graph dump at WARNING level when export meets a data-dependent
# branch; the reason is recorded in the capture's fallbacks instead.
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export")


@dataclass(frozen=True)
class PathResult:
    """What one capture path found: nodes in graph order and first-use positions."""

    nodes: tuple[NodeInfo, ...]
    first_use: dict[str, int]


@contextmanager
def _quiet_export_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_path(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], table: ParamTable
) -> PathResult:
    """Capture with ``torch.export.export(..., strict=False)``.

    Parameter placeholders map to FQNs through ``graph_signature.inputs_to_parameters``;
    export may lift a tied tensor under one or several of its names (with the uses on any
    of them), and the table folds every alias into the canonical name. A parameter's
    first use is the first node consuming any of its placeholders.
    """
    with _quiet_export_logs():
        program = torch.export.export(model, args, kwargs, strict=False)
    signature = program.graph_signature
    param_of = dict(signature.inputs_to_parameters)
    user_inputs = set(signature.user_inputs)
    graph_nodes = list(program.graph.nodes)
    position = {node: i for i, node in enumerate(graph_nodes)}
    first_use: dict[str, int] = {}
    nodes: list[NodeInfo] = []
    for node in graph_nodes:
        if node.op == "placeholder":
            fqn = param_of.get(node.name)
            if fqn is not None and node.users:
                where = min(position[user] for user in node.users)
                table.mark(first_use, [table.by_fqn.get(fqn)], where)
            if node.name not in user_inputs:
                continue
        elif node.op == "output":
            continue
        shapes, dtypes, device = tensor_meta(node.meta.get("val"))
        nodes.append(NodeInfo(node.name, node.op, op_target(node.target), shapes, dtypes, device))
    return PathResult(tuple(nodes), first_use)


def _fx_inputs(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], list[Any]]:
    """``(concrete_args, placeholder values)`` for tracing ``model.forward`` with fx.

    Arguments holding tensors become placeholders; every other argument (flags, ``None``,
    omitted defaults) is fixed to its value through ``concrete_args`` so that Python
    branches on it are decided as in the real call.
    """
    signature = inspect.signature(model.forward)
    kinds = {p.kind for p in signature.parameters.values()}
    if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        raise TypeError(
            "forward takes *args/**kwargs, which torch.fx.symbolic_trace cannot bind to "
            "placeholders"
        )
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    concrete: dict[str, Any] = {}
    values: list[Any] = []
    for name, value in bound.arguments.items():
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)):
            concrete[name] = value
        values.append(value)
    return concrete, values


class _RecordingShapeProp(torch.fx.passes.shape_prop.ShapeProp):
    """ShapeProp that also keeps each node's output shapes, dtypes and device type."""

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        n.meta["lamina_meta"] = tensor_meta(result)
        return result


def fx_path(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], table: ParamTable
) -> PathResult:
    """Capture with ``torch.fx.symbolic_trace`` and ``ShapeProp`` on the example inputs.

    Parameters are used through ``get_attr`` nodes (first use: the first node consuming
    it) and through ``call_module`` nodes of leaf modules (all of the leaf's parameters,
    its submodules' included, in registration order, at that node).
    """
    concrete, values = _fx_inputs(model, args, kwargs)
    traced = torch.fx.symbolic_trace(model, concrete_args=concrete or None)
    with torch.no_grad():
        _RecordingShapeProp(traced).propagate(*values)
    graph_nodes = list(traced.graph.nodes)
    position = {node: i for i, node in enumerate(graph_nodes)}
    first_use: dict[str, int] = {}
    nodes: list[NodeInfo] = []
    for i, node in enumerate(graph_nodes):
        if node.op == "output":
            continue
        target = op_target(node.target)
        if node.op == "get_attr" and node.users:
            where = min(position[user] for user in node.users)
            table.mark(first_use, [table.by_fqn.get(str(node.target))], where)
        elif node.op == "call_module":
            leaf = traced.get_submodule(str(node.target))
            target = qualified_name(type(leaf))
            table.mark(first_use, [table.by_id.get(id(p)) for p in leaf.parameters()], i)
        shapes, dtypes, device = node.meta.get("lamina_meta", ((), (), None))
        nodes.append(NodeInfo(node.name, node.op, target, shapes, dtypes, device))
    return PathResult(tuple(nodes), first_use)
