"""The collectives of tensor parallelism on activations, as autograd functions.

Each function is one collective forward and its adjoint backward over the tensor-parallel
group (:class:`TensorGroup`): entering a column-parallel layer copies the activation
(backward: the partial input gradients are summed), leaving a row-parallel layer sums the
partial outputs (backward: the gradient is copied), and sequence parallelism gathers the
sequence before a tensor-parallel region and keeps this rank's slice after it.

Every collective is issued as a node of the step's plan (:class:`PlannedCollective`: the
model's :class:`StepLog` and the node id :mod:`.plan_nodes` gives it), so the run log
counts what ran against what was planned; a layer issuing another op than its node plans
is an error naming both. Inside a captured step (``torch.compile`` tracing) each function
is its traceable twin from :mod:`.graph_ops` instead: the same collectives as functional
ones, counted by the compiled step per replay in the order :attr:`StepLog.order`
recorded from an eager step. Gradients of whole parameters summed over the group
(:func:`copy_params_in`) are summed by the compiled step after the backward instead: a
captured autograd function whose inputs are parameters loses its backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lamina.errors import ConfigError
from lamina.runtime import RunLog
from lamina.strategies.tp import graph_ops


@dataclass(frozen=True)
class TensorGroup:
    """This rank's tensor-parallel group: the process group, its size and this rank's
    index in it (the shard it holds)."""

    group: dist.ProcessGroup | None
    size: int
    index: int


class StepLog:
    """The run log a tensor-parallel model's collectives are recorded in, and the
    backward pass they belong to: the first collective of a backward marks it begun and
    its end (autograd's callback) ends it in the log (:meth:`RunLog.end_backward`)."""

    def __init__(self, run_log: RunLog) -> None:
        self.run_log = run_log
        self._in_backward = False
        #: The plan nodes the current step issued, in the order it issued them.
        self.order: list[str] = []

    @contextmanager
    def issuing(self, node_id: str, op: str, nbytes: int, backward: bool) -> Iterator[None]:
        """Around issuing ``op`` of ``nbytes`` (the plan's convention: an all-gather's
        output, a reduce-scatter's input) as plan node ``node_id``."""
        spec = self.run_log.plan.node(node_id).collective
        if spec is not None and spec.op != op:
            raise ConfigError(
                f"tensor parallelism issued {op} as plan node {node_id!r}, which plans "
                f"{spec.op}: the layers were split otherwise than the plan says; fix the "
                "engine (strategies/tp/apply.py)"
            )
        if backward:
            self.backward_reached()
        self.order.append(node_id)
        with self.run_log.collective(node_id, nbytes=nbytes):
            yield

    def begin_step(self) -> None:
        """A training forward starts: the log's next step opens (a backward that raised
        before its end left nothing pending)."""
        self._in_backward = False
        self.order = []
        self.run_log.begin_step()

    def backward_reached(self) -> None:
        """A collective or transfer of the backward is about to run: the first one marks
        the backward begun in the log, and autograd's end of it ends it there."""
        if self._in_backward:
            return
        self._in_backward = True
        self.run_log.begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._in_backward = False
        self.run_log.end_backward()


@dataclass(frozen=True)
class PlannedCollective:
    """One collective of the plan as a layer issues it: the model's :class:`StepLog` and
    the plan node id it is counted under."""

    log: StepLog
    node_id: str

    @contextmanager
    def issuing(self, op: str, nbytes: int, backward: bool = False) -> Iterator[None]:
        """Around issuing ``op`` of ``nbytes`` (see :meth:`StepLog.issuing`)."""
        with self.log.issuing(self.node_id, op, nbytes, backward):
            yield


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_reduce(
    x: torch.Tensor, tp: TensorGroup, node: PlannedCollective, backward: bool
) -> torch.Tensor:
    out = x.contiguous().clone()
    with node.issuing("all_reduce", _nbytes(out), backward):
        dist.all_reduce(out, group=tp.group)
    return out


def _gather(
    x: torch.Tensor, dim: int, tp: TensorGroup, node: PlannedCollective, backward: bool
) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(tp.size)]
    # counted as its output: the whole tensor, tp slices of x's size
    with node.issuing("all_gather", _nbytes(x) * tp.size, backward):
        dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def _slice(x: torch.Tensor, dim: int, tp: TensorGroup) -> torch.Tensor:
    return x.chunk(tp.size, dim=dim)[tp.index].contiguous()


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, tp: TensorGroup, grad_node: PlannedCollective
    ) -> torch.Tensor:
        ctx.tp, ctx.grad_node = tp, grad_node
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.tp, ctx.grad_node, backward=True), None, None


class _CopyParamsIn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tp: TensorGroup, grad_node: PlannedCollective, *params: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.tp, ctx.grad_node = tp, grad_node
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # one all-reduce for all of them, as the plan's node says
        flat = torch.cat([g.reshape(-1) for g in grads])
        summed = _all_reduce(flat, ctx.tp, ctx.grad_node, backward=True)
        pieces = torch.split(summed, [g.numel() for g in grads])
        return None, None, *(p.view_as(g) for p, g in zip(pieces, grads, strict=True))


class _SumOut(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, tp: TensorGroup, node: PlannedCollective
    ) -> torch.Tensor:
        return _all_reduce(x, tp, node, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, tp: TensorGroup, node: PlannedCollective
    ) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return _gather(x, dim, tp, node, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # a view of this rank's slice: no copy of it (autograd takes strided gradients)
        return grad.chunk(ctx.tp.size, dim=ctx.dim)[ctx.tp.index], None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, tp: TensorGroup, grad_node: PlannedCollective
    ) -> torch.Tensor:
        ctx.tp, ctx.dim, ctx.grad_node = tp, dim, grad_node
        return _slice(x, dim, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.tp, ctx.grad_node, backward=True), None, None, None


class _SumScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        dim: int,
        tp: TensorGroup,
        node: PlannedCollective,
        grad_node: PlannedCollective,
    ) -> torch.Tensor:
        ctx.tp, ctx.dim, ctx.grad_node = tp, dim, grad_node
        if dist.get_backend(tp.group) == "gloo":
            # gloo's all-reduce beats its reduce-scatter (64 MB on 2 ranks: 75 ms vs 140);
            # the same bytes as the planned reduce-scatter's input, recorded as it
            whole = x.contiguous().clone()
            with node.issuing("reduce_scatter", _nbytes(whole)):
                dist.all_reduce(whole, group=tp.group)
            return _slice(whole, dim, tp)
        chunks = [c.contiguous() for c in x.chunk(tp.size, dim=dim)]
        out = torch.empty_like(chunks[tp.index])
        with node.issuing("reduce_scatter", _nbytes(x)):
            dist.reduce_scatter(out, chunks, group=tp.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return _gather(grad, ctx.dim, ctx.tp, ctx.grad_node, backward=True), None, None, None, None


def copy_in(x: torch.Tensor, tp: TensorGroup, grad_node: PlannedCollective) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over the group (into column-parallel layers),
    issued as ``grad_node``."""
    if torch.compiler.is_compiling():
        traced: torch.Tensor = graph_ops.CopyIn.apply(x, graph_ops.group_of(tp.group))  # type: ignore[no-untyped-call]
        return traced
    out: torch.Tensor = _CopyIn.apply(x, tp, grad_node)  # type: ignore[no-untyped-call]
    return out


def copy_params_in(
    params: Sequence[torch.Tensor], tp: TensorGroup, grad_node: PlannedCollective
) -> tuple[torch.Tensor, ...]:
    """``params`` unchanged; their gradients summed over the group in one all-reduce
    (parameters of modules on sequence slices), issued as ``grad_node``."""
    if torch.compiler.is_compiling():  # the compiled step sums their gradients itself
        return tuple(params)
    out: tuple[torch.Tensor, ...] = _CopyParamsIn.apply(tp, grad_node, *params)  # type: ignore[no-untyped-call]
    return out


def sum_out(x: torch.Tensor, tp: TensorGroup, node: PlannedCollective) -> torch.Tensor:
    """The sum of every rank's partial ``x`` (out of a row-parallel layer), issued as
    ``node``."""
    if torch.compiler.is_compiling():
        traced: torch.Tensor = graph_ops.SumOut.apply(x, graph_ops.group_of(tp.group))  # type: ignore[no-untyped-call]
        return traced
    out: torch.Tensor = _SumOut.apply(x, tp, node)  # type: ignore[no-untyped-call]
    return out


def gather(x: torch.Tensor, dim: int, tp: TensorGroup, node: PlannedCollective) -> torch.Tensor:
    """Every rank's slice of ``dim`` concatenated, issued as ``node`` (backward: this
    rank's slice)."""
    if torch.compiler.is_compiling():
        traced: torch.Tensor = graph_ops.Gather.apply(x, dim, graph_ops.group_of(tp.group))  # type: ignore[no-untyped-call]
        return traced
    out: torch.Tensor = _Gather.apply(x, dim, tp, node)  # type: ignore[no-untyped-call]
    return out


def keep_slice(
    x: torch.Tensor, dim: int, tp: TensorGroup, grad_node: PlannedCollective
) -> torch.Tensor:
    """This rank's slice of ``dim`` of a replicated ``x`` (backward: gathered, issued as
    ``grad_node``)."""
    if torch.compiler.is_compiling():
        traced: torch.Tensor = graph_ops.KeepSlice.apply(x, dim, graph_ops.group_of(tp.group))  # type: ignore[no-untyped-call]
        return traced
    out: torch.Tensor = _Slice.apply(x, dim, tp, grad_node)  # type: ignore[no-untyped-call]
    return out


def sum_scatter(
    x: torch.Tensor,
    dim: int,
    tp: TensorGroup,
    node: PlannedCollective,
    grad_node: PlannedCollective,
) -> torch.Tensor:
    """This rank's slice of ``dim`` of the sum of every rank's partial ``x``, issued as
    ``node`` (backward: gathered, issued as ``grad_node``)."""
    if torch.compiler.is_compiling():
        traced: torch.Tensor = graph_ops.SumScatter.apply(x, dim, graph_ops.group_of(tp.group))  # type: ignore[no-untyped-call]
        return traced
    out: torch.Tensor = _SumScatter.apply(x, dim, tp, node, grad_node)  # type: ignore[no-untyped-call]
    return out
