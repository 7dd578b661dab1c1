"""Sizes of a split dim that a model's code writes whole, scaled to this rank's slice:
:func:`scale_written_sizes`.

A fused projection cut with its sizes written in the code (``split([q, kv, kv])``) or
features viewed as ``view(b, s, self.heads, d)`` name the whole model's sizes; on a tp
rank the tensor holds ``1/tp`` of that dim. The plan lists each such call
(:class:`~.layers.WrittenSize`); while the module that makes it runs, a torch function
mode divides that size by the tp size, for the listed call only: the op, the number of
sizes and the whole value at the listed position must all match, and a view whose
sizes already fit its input is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lamina.strategies.tp.layers import WrittenSize


class _ScaledSizes(TorchFunctionMode):
    """Divides the listed sizes of the listed calls by ``size``."""

    def __init__(self, written: Sequence[WrittenSize], size: int) -> None:
        super().__init__()
        self.written, self.size = tuple(written), size

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("split", "split_with_sizes") and len(args) > 1:
            args = (args[0], self._split_sizes(name, args[0], args[1]), *args[2:])
        elif name in ("view", "reshape") and len(args) > 1 and not kwargs:
            sizes = tuple(args[1]) if len(args) == 2 and not isinstance(args[1], int) else args[1:]
            scaled = self._view_sizes(name, args[0], tuple(sizes))
            if scaled is not None:
                args = (args[0], scaled)
        return func(*args, **kwargs)

    def _split_sizes(self, name: str, x: Any, sizes: Any) -> Any:
        listed = (sizes,) if isinstance(sizes, int) else tuple(sizes)
        for written in self.written:
            if written.op == name and written.sizes == listed:
                scaled = [s // self.size for s in listed]
                return scaled[0] if isinstance(sizes, int) else scaled
        return sizes

    def _view_sizes(self, name: str, x: Any, sizes: tuple[Any, ...]) -> tuple[int, ...] | None:
        if not isinstance(x, torch.Tensor) or not all(isinstance(s, int) for s in sizes):
            return None
        for written in self.written:
            at = written.position
            if (
                written.op == name
                and len(written.sizes) == len(sizes)
                and sizes[at] == written.sizes[at]
            ):
                fits = -1 in sizes or _product(sizes) == x.numel()
                if -1 not in sizes and fits:
                    return None  # already this slice's sizes
                return (*sizes[:at], sizes[at] // self.size, *sizes[at + 1 :])
        return None


def _product(sizes: Sequence[int]) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out


def scale_written_sizes(model: nn.Module, written: Sequence[WrittenSize], size: int) -> None:
    """Each module named in ``written`` runs its forward under the mode that scales its
    listed sizes to the slice (its ``forward`` wrapped, in place)."""
    by_module: dict[str, list[WrittenSize]] = {}
    for entry in written:
        by_module.setdefault(entry.module, []).append(entry)
    for name, entries in by_module.items():
        module = model.get_submodule(name) if name else model
        original = module.forward
        mode = _ScaledSizes(entries, size)

        def forward(*args: Any, _run: Any = original, _mode: Any = mode, **kwargs: Any) -> Any:
            with _mode:
                return _run(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
