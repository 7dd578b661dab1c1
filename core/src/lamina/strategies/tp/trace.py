"""One forward recorded op by op, with the module that ran each op: the graph the
tensor-parallel plan is derived from (:func:`record_forward`).

A ``TorchFunctionMode`` sees every torch function and tensor method the forward calls, on
real (or meta) tensors, whatever Python control flow the model has; module hooks keep
the stack of modules running. Nothing changes in the model: parameters, buffers, modes
and random states are as before (:func:`lamina.graph.state.preserved`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from lamina.graph.state import preserved


@dataclass
class OpRecord:
    """One op: the function, its tensor inputs (positions in ``args``), its output
    tensors, the modules running (innermost last) and the raw arguments."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    result: Any
    stack: tuple[str, ...]


@dataclass
class ModuleCall:
    """A module's call: its name, tensor arguments (position or keyword -> tensor) and
    tensor outputs."""

    name: str
    args: dict[int | str, torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)
    #: Index of the first op inside the call and of the first op after it.
    start: int = 0
    end: int = 0
    #: The call's own arguments, tensors and others (to run it again on a slice).
    raw_args: tuple[Any, ...] = ()
    raw_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordedForward:
    """Every op and module call of one forward, and the model's output tensors."""

    ops: list[OpRecord]
    calls: list[ModuleCall]
    outputs: list[torch.Tensor]


class _Recorder(TorchFunctionMode):
    def __init__(self, stack: list[str], ops: list[OpRecord]) -> None:
        super().__init__()
        self.stack, self.ops = stack, ops

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        if inputs or outputs:
            self.ops.append(
                OpRecord(func, args, kwargs, inputs, outputs, result, tuple(self.stack))
            )
        return result


def record_forward(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> RecordedForward:
    """``model(*args, **kwargs)`` recorded (see the module); run without gradients."""
    ops: list[OpRecord] = []
    calls: list[ModuleCall] = []
    stack: list[str] = []
    handles: list[RemovableHandle] = []
    open_calls: list[ModuleCall] = []
    for name, module in model.named_modules():
        enter = _enter(name, stack, calls, open_calls, ops)
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(_leave(stack, open_calls, ops)))
    try:
        with preserved(model), torch.no_grad(), _Recorder(stack, ops):
            out = model(*args, **(kwargs or {}))
    finally:
        for handle in handles:
            handle.remove()
    outputs = [t for t in pytree.tree_leaves(_plain(out)) if isinstance(t, torch.Tensor)]
    return RecordedForward(ops, calls, outputs)


def _plain(out: Any) -> Any:
    """A transformers ModelOutput (an ordered dict) as its values."""
    return (
        list(out.values()) if hasattr(out, "values") and not isinstance(out, torch.Tensor) else out
    )


def _enter(
    name: str,
    stack: list[str],
    calls: list[ModuleCall],
    open_calls: list[ModuleCall],
    ops: list[OpRecord],
) -> Callable[..., None]:
    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors: dict[int | str, torch.Tensor] = {
            i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)
        }
        tensors.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        call = ModuleCall(name, tensors, start=len(ops), raw_args=args, raw_kwargs=dict(kwargs))
        calls.append(call)
        open_calls.append(call)
        stack.append(name)

    return hook


def _leave(
    stack: list[str], open_calls: list[ModuleCall], ops: list[OpRecord]
) -> Callable[..., None]:
    def hook(_module: nn.Module, _args: Any, out: Any) -> None:
        call = open_calls.pop()
        call.end = len(ops)
        call.outputs = [t for t in pytree.tree_leaves(_plain(out)) if isinstance(t, torch.Tensor)]
        stack.pop()

    return hook
