"""The last-resort capture path: run one real forward and watch it.

Forward pre/post hooks on every module give one node per module call (in call order,
with its output shapes); a dispatch mode sees every ATen op and records the first op that
reads each parameter, which is exact even for parameters a container module uses directly
(a positional embedding) and leaves out parameters a called module never reads. Works for
any forward, data-dependent Python control flow included, at the price of describing only
the branch these example inputs take.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lamina.graph.metadata import NodeInfo, qualified_name, tensor_meta
from lamina.graph.params import ParamTable
from lamina.graph.paths import PathResult

ROOT_NAME = "(root)"


class _ParamReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts ATen ops and remembers the first op that reads each trainable parameter."""

    def __init__(self, table: ParamTable) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.table = table
        self.ops = 0
        self.first_use: dict[str, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        reads = [
            self.table.by_id.get(id(leaf))
            for leaf in pytree.tree_leaves((args, kwargs))
            if isinstance(leaf, torch.Tensor)
        ]
        self.table.mark(self.first_use, reads, self.ops)
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _CallRecorder:
    """Module hooks that append one node per module call, in the order calls begin.

    A module called more than once (shared, or looped over) gets ``path#k`` for its
    ``k``-th call after the first.
    """

    def __init__(self, model: nn.Module) -> None:
        self.paths = {id(m): (p or ROOT_NAME) for p, m in model.named_modules()}
        self.calls: dict[int, int] = {}
        self.open: dict[int, list[tuple[int, int]]] = {}
        self.slots: list[NodeInfo | None] = []

    def before(self, module: nn.Module, args: Any) -> None:
        index = self.calls.get(id(module), 0)
        self.calls[id(module)] = index + 1
        self.open.setdefault(id(module), []).append((len(self.slots), index))
        self.slots.append(None)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        slot, index = self.open[id(module)].pop()
        path = self.paths[id(module)]
        name = f"{path}#{index}" if index else path
        shapes, dtypes, device = tensor_meta(output)
        target = qualified_name(type(module))
        self.slots[slot] = NodeInfo(name, "module", target, shapes, dtypes, device)

    def nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(node for node in self.slots if node is not None)


def hook_path(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], table: ParamTable
) -> PathResult:
    """Run ``model(*args, **kwargs)`` once under ``torch.no_grad()`` with hooks attached.

    The caller restores buffers, modes and RNG state afterwards
    (:func:`lamina.graph.state.preserved`).
    """
    recorder = _CallRecorder(model)
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(recorder.before))
        handles.append(module.register_forward_hook(recorder.after))
    reads = _ParamReads(table)
    try:
        with torch.no_grad(), reads:
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return PathResult(recorder.nodes(), reads.first_use)
