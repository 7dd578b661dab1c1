"""A :class:`~.layers.TensorPlan` applied to a model in place: :func:`apply_plan`.

Each split parameter keeps its Python object (``torch.utils.swap_tensors``: optimizers,
tied weights and user references stay valid) and becomes this rank's slice: rows of a
column-parallel weight (chunk by chunk for a fused projection), columns of a row-parallel
one, rows (vocabulary) of an embedding or head. Module hooks put the plan's collectives
(:mod:`.activation_ops`) where the plan says. Works on the meta device too: slicing a
meta tensor allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lamina.strategies.tp.activation_ops import (
    TensorGroup,
    copy_in,
    gather,
    keep_slice,
    sum_out,
    sum_scatter,
)
from lamina.strategies.tp.layers import Region, Row, TensorPlan
from lamina.strategies.tp.loss_parallel import HeadOutputs

Hook = Callable[..., Any]
#: Parameter (id or name) -> (split dim, chunks, whole shape).
Splits = dict[Any, tuple[int, int, tuple[int, ...]]]


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_plan` did: its hook handles, and each split parameter's split
    by every name it has."""

    handles: list[Any]
    splits: Splits
    heads: HeadOutputs


@dataclass
class _Entered:
    """The activations column-parallel layers received this forward, each prepared once
    (gathered on the sequence with sequence parallelism, then copied in: its gradient
    is summed once however many layers read it); cleared when the forward ends."""

    prepared: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def hook(self, plan: TensorPlan, tp: TensorGroup, gathers: bool) -> Hook:
        """A forward pre-hook giving a column-parallel layer its prepared input
        (``gathers``: the input is still a sequence slice, gathered here)."""

        def enter(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            held = self.prepared.get(id(x))
            if held is None or held[0] is not x:  # held[0] stays alive: no id reuse
                ready = gather(x, plan.seq_dim, tp) if gathers else x
                held = (x, copy_in(ready, tp))
                self.prepared[id(x)] = held
            return (held[1], *args[1:])

        return enter


def shard_rows(tensor: torch.Tensor, tp: TensorGroup, chunks: int = 1) -> torch.Tensor:
    """This rank's rows of ``tensor``: each of its ``chunks`` row blocks split ``tp`` ways."""
    blocks = tensor.reshape(chunks, tensor.shape[0] // chunks, *tensor.shape[1:])
    mine = blocks.chunk(tp.size, dim=1)[tp.index]
    return mine.reshape(-1, *tensor.shape[1:])


def shard_columns(tensor: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """This rank's slice of ``tensor``'s last dim."""
    return tensor.chunk(tp.size, dim=-1)[tp.index]


def apply_plan(model: nn.Module, plan: TensorPlan, tp: TensorGroup) -> Applied:
    """``model`` split as ``plan`` says, in place."""
    handles: list[Any] = []
    done: Splits = {}
    entered = _Entered()
    heads = HeadOutputs()
    for region in plan.regions:
        handles += _apply_region(model, region, plan, tp, done, entered)
    for emb in plan.embeddings:
        module: Any = model.get_submodule(emb.module)
        _swap(module.weight, 0, 1, tp, done)
        module.forward = _vocab_lookup(module, tp)  # type: ignore[method-assign]
    for head in plan.heads:
        module = model.get_submodule(head.module)
        _swap(module.weight, 0, 1, tp, done)
        if getattr(module, "bias", None) is not None:
            _swap(module.bias, 0, 1, tp, done)
        handles.append(
            module.register_forward_pre_hook(entered.hook(plan, tp, plan.sequence_parallel))
        )
        handles.append(module.register_forward_hook(lambda _m, _a, out: heads.finish(out, tp)))
    if plan.sequence_parallel:
        handles += _apply_sequence(model, plan, tp)

    def forget(*_: Any) -> None:
        entered.prepared.clear()

    # cleared when a forward starts too: a pipeline stage's forward ends by an exception
    handles.append(model.register_forward_pre_hook(forget))
    handles.append(model.register_forward_hook(forget))
    names = {
        name: done[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in done
    }
    return Applied(handles, names, heads)


def _apply_region(
    model: nn.Module,
    region: Region,
    plan: TensorPlan,
    tp: TensorGroup,
    done: Splits,
    entered: _Entered,
) -> list[Any]:
    handles: list[Any] = []
    for column in region.columns:
        linear: Any = model.get_submodule(column.linear)
        _swap(linear.weight, 0, column.chunks, tp, done)
        if linear.bias is not None:
            _swap(linear.bias, 0, column.chunks, tp, done)
        gathers = plan.sequence_parallel and not region.owned
        handles.append(linear.register_forward_pre_hook(entered.hook(plan, tp, gathers)))
    for row in region.rows:
        linear = model.get_submodule(row.linear)
        _swap(linear.weight, -1, 1, tp, done)
        linear.forward = _row_forward(linear, row, plan, tp)  # type: ignore[method-assign]
    module = model.get_submodule(region.module)
    if plan.sequence_parallel and region.owned:
        # the module sees its input whole (attention reads the sequence length off it)
        entry = _gather_entry(region.entry, plan, tp)
        handles.append(module.register_forward_pre_hook(entry, with_kwargs=True))
    if plan.sequence_parallel and any(r.reduce == "sum" for r in region.rows):
        # partial outputs summed whole (several rows feed the output): keep this slice
        handles.append(module.register_forward_hook(_slice_exit(plan, tp)))
    return handles


def _swap(param: Any, dim: int, chunks: int, tp: TensorGroup, done: Splits) -> None:
    """``param`` (the same object) becomes its slice on ``dim`` (once: tied weights are
    split once), recorded in ``done``."""
    if id(param) in done:
        return
    whole = param.detach()
    done[id(param)] = (dim, chunks, tuple(whole.shape))
    local = shard_rows(whole, tp, chunks) if dim == 0 else shard_columns(whole, tp)
    assert isinstance(param, nn.Parameter)
    replacement = nn.Parameter(local.clone(), requires_grad=param.requires_grad)
    replacement.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, replacement)  # type: ignore[no-untyped-call]


def _row_forward(linear: Any, row: Row, plan: TensorPlan, tp: TensorGroup) -> Hook:
    def forward(x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, linear.weight)
        bias = linear.bias
        if row.reduce == "scatter" and plan.sequence_parallel:
            out = sum_scatter(partial, plan.seq_dim, tp)
            # added on sequence slices: its gradient is summed over the group
            bias = None if bias is None else copy_in(bias, tp)
        else:
            out = sum_out(partial, tp)
        return out if bias is None else out + bias

    return forward


def _vocab_lookup(module: Any, tp: TensorGroup) -> Hook:
    rows = module.weight.shape[0]
    start = rows * tp.index

    def forward(ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < start) | (ids >= start + rows)
        local = (ids - start).masked_fill(outside, 0)
        pad = module.padding_idx
        pad = pad - start if pad is not None and start <= pad < start + rows else None
        out = F.embedding(
            local,
            module.weight,
            pad,
            module.max_norm,
            module.norm_type,
            module.scale_grad_by_freq,
            module.sparse,
        )
        return sum_out(out.masked_fill(outside.unsqueeze(-1), 0.0), tp)

    return forward


def _gather_entry(entry: int | str, plan: TensorPlan, tp: TensorGroup) -> Hook:
    def hook(
        _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if isinstance(entry, int) and entry < len(args):
            args = (*args[:entry], gather(args[entry], plan.seq_dim, tp), *args[entry + 1 :])
        elif isinstance(entry, str) and entry in kwargs:
            kwargs = {**kwargs, entry: gather(kwargs[entry], plan.seq_dim, tp)}
        return args, kwargs

    return hook


def _slice_exit(plan: TensorPlan, tp: TensorGroup) -> Hook:
    def hook(_module: nn.Module, _args: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return keep_slice(out, plan.seq_dim, tp)
        return (keep_slice(out[0], plan.seq_dim, tp), *out[1:])

    return hook


def _apply_sequence(model: nn.Module, plan: TensorPlan, tp: TensorGroup) -> list[Any]:
    """The first block's input split on the sequence; the parameters of the modules on
    sequence slices summed over the group in backward."""
    handles = []
    first = model.get_submodule(plan.split_at)

    def split(
        _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (keep_slice(args[0], plan.seq_dim, tp), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        return args, {**kwargs, key: keep_slice(kwargs[key], plan.seq_dim, tp)}

    handles.append(first.register_forward_pre_hook(split, with_kwargs=True))
    for name in plan.sequence_modules:
        module = model.get_submodule(name)
        held: dict[str, Any] = {}
        handles.append(module.register_forward_pre_hook(_sum_params_in(held, tp)))
        handles.append(module.register_forward_hook(_sum_params_out(held)))
    return handles


def _sum_params_in(held: dict[str, Any], tp: TensorGroup) -> Hook:
    def hook(module: nn.Module, _args: Any) -> None:
        for name, param in list(module._parameters.items()):
            if param is not None and param.requires_grad:
                held[name] = param
                module._parameters[name] = copy_in(param, tp)  # type: ignore[assignment]

    return hook


def _sum_params_out(held: dict[str, Any]) -> Hook:
    def hook(module: nn.Module, _args: Any, _out: Any) -> None:
        for name, param in held.items():
            module._parameters[name] = param
        held.clear()

    return hook
