"""A :class:`~.layers.TensorPlan` applied to a model in place: :func:`apply_plan`.

Each split parameter keeps its Python object (``torch.utils.swap_tensors``: optimizers,
tied weights and user references stay valid) and becomes this rank's slice: rows of a
column-parallel weight (chunk by chunk for a fused projection), columns of a row-parallel
one, rows (vocabulary) of an embedding or head. Module hooks put the plan's collectives
(:mod:`.activation_ops`) where the plan says, each issued under its plan node's id
(:mod:`.plan_nodes`) into the model's run log; a training forward opens the log's next
step. Works on the meta device too: slicing a meta tensor allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lamina.runtime import RunLog
from lamina.strategies.tp.activation_ops import (
    PlannedCollective,
    StepLog,
    TensorGroup,
    copy_in,
    copy_params_in,
    gather,
    keep_slice,
    sum_out,
    sum_scatter,
)
from lamina.strategies.tp.layers import Region, Row, TensorPlan
from lamina.strategies.tp.loss_parallel import HeadOutputs
from lamina.strategies.tp.plan_nodes import (
    backward_node,
    bias_node,
    exit_node,
    forward_node,
    gather_node,
    params_node,
    split_node,
)
from lamina.strategies.tp.written_sizes import scale_written_sizes

Hook = Callable[..., Any]
#: Parameter (id or name) -> (split dim, row parts, whole shape).
Splits = dict[Any, tuple[int, tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_plan` did: its hook handles, and each split parameter's split
    by every name it has."""

    handles: list[Any]
    splits: Splits
    heads: HeadOutputs
    #: The run log's view of the step: what it issued, in order.
    log: StepLog


@dataclass
class _Entered:
    """The activations column-parallel layers received this forward, each prepared once
    (gathered on the sequence with sequence parallelism, then copied in: its gradient
    is summed once however many layers read it); cleared when the forward ends."""

    prepared: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def hook(
        self,
        plan: TensorPlan,
        tp: TensorGroup,
        gathers: PlannedCollective | None,
        grad_summed: PlannedCollective,
    ) -> Hook:
        """A forward pre-hook giving a column-parallel layer (or a head) its prepared
        input: ``gathers`` (None: the input is whole) gathers a sequence slice, and the
        input's gradient is summed as ``grad_summed``."""

        def enter(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            held = self.prepared.get(id(x))
            if held is None or held[0] is not x:  # held[0] stays alive: no id reuse
                ready = x if gathers is None else gather(x, plan.seq_dim, tp, gathers)
                held = (x, copy_in(ready, tp, grad_summed))
                self.prepared[id(x)] = held
            return (held[1], *args[1:])

        return enter


def shard_rows(
    tensor: torch.Tensor, tp: TensorGroup, parts: int | tuple[int, ...] = 1
) -> torch.Tensor:
    """This rank's rows of ``tensor``: each of its row blocks (``parts``: that many equal
    ones, or blocks of these sizes) split ``tp`` ways."""
    sizes = _row_parts(tensor.shape[0], parts)
    if len(sizes) == 1:
        return tensor.chunk(tp.size, dim=0)[tp.index]
    blocks = torch.split(tensor, list(sizes), dim=0)
    return torch.cat([block.chunk(tp.size, dim=0)[tp.index] for block in blocks], dim=0)


def _row_parts(rows: int, parts: int | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(parts, tuple):
        return parts
    return (rows // parts,) * parts


def shard_columns(tensor: torch.Tensor, tp: TensorGroup) -> torch.Tensor:
    """This rank's slice of ``tensor``'s last dim."""
    return tensor.chunk(tp.size, dim=-1)[tp.index]


def apply_plan(model: nn.Module, plan: TensorPlan, tp: TensorGroup, run_log: RunLog) -> Applied:
    """``model`` split as ``plan`` says, in place; its collectives recorded in
    ``run_log`` (whose plan holds their nodes: :func:`.plan_nodes.build_tensor_plan`
    of ``plan``), each training forward opening its next step."""
    handles: list[Any] = []
    done: Splits = {}
    entered = _Entered()
    heads = HeadOutputs()
    log = StepLog(run_log)
    for region in plan.regions:
        handles += _apply_region(model, region, plan, tp, done, entered, log)
    for emb in plan.embeddings:
        module: Any = model.get_submodule(emb.module)
        _swap(module.weight, 0, 1, tp, done)
        summed = PlannedCollective(log, forward_node(emb.module))
        module.forward = _vocab_lookup(module, tp, summed)  # type: ignore[method-assign]
    for head in plan.heads:
        module = model.get_submodule(head.module)
        _swap(module.weight, 0, 1, tp, done)
        if getattr(module, "bias", None) is not None:
            _swap(module.bias, 0, 1, tp, done)
        gathers = PlannedCollective(log, gather_node(head.module))
        grad_summed = PlannedCollective(log, backward_node(head.module))
        enter = entered.hook(plan, tp, gathers if plan.sequence_parallel else None, grad_summed)
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(_finish_head(heads, tp, log, head.module)))
    if plan.sequence_parallel:
        handles += _apply_sequence(model, plan, tp, log)
    for name, _ in plan.shared_modules:  # whole parameters, each rank's part of the gradient
        handles += _summed_params(model, name, tp, log)
    scale_written_sizes(model, plan.written_sizes, tp.size)

    def forget(*_: Any) -> None:
        entered.prepared.clear()

    def open_step(module: nn.Module, _args: Any) -> None:
        # a captured step opens its steps in the log itself, once per replay
        if module.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            log.begin_step()

    handles.append(model.register_forward_pre_hook(open_step))
    # cleared when a forward starts too: a pipeline stage's forward ends by an exception
    handles.append(model.register_forward_pre_hook(forget))
    handles.append(model.register_forward_hook(forget))
    names = {
        name: done[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in done
    }
    return Applied(handles, names, heads, log)


def _finish_head(heads: HeadOutputs, tp: TensorGroup, log: StepLog, head: str) -> Hook:
    gathered = PlannedCollective(log, forward_node(head))

    def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return heads.finish(out, tp, gathered)

    return hook


def _apply_region(
    model: nn.Module,
    region: Region,
    plan: TensorPlan,
    tp: TensorGroup,
    done: Splits,
    entered: _Entered,
    log: StepLog,
) -> list[Any]:
    handles: list[Any] = []
    gathered = PlannedCollective(log, gather_node(region.module))
    grad_summed = PlannedCollective(log, backward_node(region.module))
    for column in region.columns:
        linear: Any = model.get_submodule(column.linear)
        parts = column.parts(int(linear.weight.shape[0]))
        _swap(linear.weight, 0, parts, tp, done)
        if linear.bias is not None:
            _swap(linear.bias, 0, parts, tp, done)
        gathers = gathered if plan.sequence_parallel and not region.owned else None
        handles.append(
            linear.register_forward_pre_hook(entered.hook(plan, tp, gathers, grad_summed))
        )
    for row in region.rows:
        linear = model.get_submodule(row.linear)
        _swap(linear.weight, -1, 1, tp, done)
        linear.forward = _row_forward(linear, row, plan, tp, log)  # type: ignore[method-assign]
    module = model.get_submodule(region.module)
    if plan.sequence_parallel and region.owned:
        # the module sees its input whole (attention reads the sequence length off it)
        entry = _gather_entry(region.entry, plan, tp, gathered)
        handles.append(module.register_forward_pre_hook(entry, with_kwargs=True))
    if plan.sequence_parallel and any(r.reduce == "sum" for r in region.rows):
        # partial outputs summed whole (several rows feed the output): keep this slice
        exit_gathered = PlannedCollective(log, exit_node(region.module))
        handles.append(module.register_forward_hook(_slice_exit(plan, tp, exit_gathered)))
    return handles


def _swap(
    param: Any, dim: int, parts: int | tuple[int, ...], tp: TensorGroup, done: Splits
) -> None:
    """``param`` (the same object) becomes its slice on ``dim`` (once: tied weights are
    split once; rows ``parts`` blocks at a time), recorded in ``done``."""
    if id(param) in done:
        return
    whole = param.detach()
    done[id(param)] = (dim, _row_parts(int(whole.shape[0]), parts), tuple(whole.shape))
    local = shard_rows(whole, tp, parts) if dim == 0 else shard_columns(whole, tp)
    assert isinstance(param, nn.Parameter)
    replacement = nn.Parameter(local.clone(), requires_grad=param.requires_grad)
    replacement.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, replacement)  # type: ignore[no-untyped-call]


def _row_forward(linear: Any, row: Row, plan: TensorPlan, tp: TensorGroup, log: StepLog) -> Hook:
    summed = PlannedCollective(log, forward_node(row.linear))
    grad_gathered = PlannedCollective(log, backward_node(row.linear))
    bias_summed = PlannedCollective(log, bias_node(row.linear))

    def forward(x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, linear.weight)
        bias = linear.bias
        if row.reduce == "scatter" and plan.sequence_parallel:
            out = sum_scatter(partial, plan.seq_dim, tp, summed, grad_gathered)
            # added on sequence slices: its gradient is summed over the group
            bias = None if bias is None else copy_params_in([bias], tp, bias_summed)[0]
        else:
            out = sum_out(partial, tp, summed)
        return out if bias is None else out + bias

    return forward


def _vocab_lookup(module: Any, tp: TensorGroup, summed: PlannedCollective) -> Hook:
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
        return sum_out(out.masked_fill(outside.unsqueeze(-1), 0.0), tp, summed)

    return forward


def _gather_entry(
    entry: int | str, plan: TensorPlan, tp: TensorGroup, gathered: PlannedCollective
) -> Hook:
    def hook(
        _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if isinstance(entry, int) and entry < len(args):
            whole = gather(args[entry], plan.seq_dim, tp, gathered)
            args = (*args[:entry], whole, *args[entry + 1 :])
        elif isinstance(entry, str) and entry in kwargs:
            kwargs = {**kwargs, entry: gather(kwargs[entry], plan.seq_dim, tp, gathered)}
        return args, kwargs

    return hook


def _slice_exit(plan: TensorPlan, tp: TensorGroup, grad_gathered: PlannedCollective) -> Hook:
    def hook(_module: nn.Module, _args: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return keep_slice(out, plan.seq_dim, tp, grad_gathered)
        return (keep_slice(out[0], plan.seq_dim, tp, grad_gathered), *out[1:])

    return hook


def _apply_sequence(model: nn.Module, plan: TensorPlan, tp: TensorGroup, log: StepLog) -> list[Any]:
    """The first block's input split on the sequence; the parameters of the modules on
    sequence slices summed over the group in backward."""
    handles = []
    first = model.get_submodule(plan.split_at)
    grad_gathered = PlannedCollective(log, split_node(plan.split_at))

    def split(
        _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (keep_slice(args[0], plan.seq_dim, tp, grad_gathered), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        return args, {**kwargs, key: keep_slice(kwargs[key], plan.seq_dim, tp, grad_gathered)}

    handles.append(first.register_forward_pre_hook(split, with_kwargs=True))
    for name in plan.sequence_modules:
        handles += _summed_params(model, name, tp, log)
    return handles


def _summed_params(model: nn.Module, name: str, tp: TensorGroup, log: StepLog) -> list[Any]:
    """Hooks summing the gradients of module ``name``'s own parameters over the group."""
    module = model.get_submodule(name)
    held: dict[str, Any] = {}
    summed = PlannedCollective(log, params_node(name))
    return [
        module.register_forward_pre_hook(_sum_params_in(held, tp, summed)),
        module.register_forward_hook(_sum_params_out(held)),
    ]


def _sum_params_in(held: dict[str, Any], tp: TensorGroup, summed: PlannedCollective) -> Hook:
    def hook(module: nn.Module, _args: Any) -> None:
        for name, param in module._parameters.items():
            if param is not None and param.requires_grad:
                held[name] = param
        if held:  # their gradients summed in one all-reduce, the plan's node
            views = copy_params_in(list(held.values()), tp, summed)
            for name, view in zip(held, views, strict=True):
                module._parameters[name] = view  # type: ignore[assignment]

    return hook


def _sum_params_out(held: dict[str, Any]) -> Hook:
    def hook(module: nn.Module, _args: Any, _out: Any) -> None:
        for name, param in held.items():
            module._parameters[name] = param
        held.clear()

    return hook
