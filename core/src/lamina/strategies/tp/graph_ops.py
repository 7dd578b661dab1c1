"""Tensor parallelism's activation collectives inside a captured step.

What :mod:`.activation_ops` issues with ``torch.distributed`` calls, written with
``torch.distributed._functional_collectives`` as autograd functions whose context is set
apart from their forward (``setup_context``), so ``torch.compile`` captures them, under
``torch.func.grad_and_value``, into the step's one graph. The same collective forward and
its adjoint backward as the eager functions, in the same forms: on gloo a sequence
gather is one broadcast per rank and a sum-scatter an all-reduce and this rank's slice
(gloo's fast forms, the eager step's too); elsewhere the backend's own all-gather and
reduce-scatter. Nothing is logged here: the compiled step records the plan's nodes of
each replay itself (:mod:`lamina.strategies.compiled`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from lamina.strategies.compiled.graph_algorithms import gather_over


def group_of(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group a tensor-parallel group's collectives run over."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    return pg


def native(pg: dist.ProcessGroup) -> bool:
    """Whether the backend's own all-gather and reduce-scatter serve (not gloo)."""
    return str(dist.get_backend(pg)) != "gloo"


def all_reduced(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    """The sum of every rank's ``x``."""
    out: torch.Tensor = funcol.all_reduce(x.contiguous(), "sum", pg)
    return out


def gathered(x: torch.Tensor, dim: int, pg: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` concatenated on ``dim``, in group-rank order."""
    size = dist.get_world_size(pg)
    flat = gather_over(x.contiguous().view(-1), pg, native(pg))
    return torch.cat(list(flat.view(size, *x.shape).unbind(0)), dim=dim)


def this_slice(x: torch.Tensor, dim: int, pg: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice of ``dim``."""
    return x.chunk(dist.get_world_size(pg), dim=dim)[dist.get_rank(pg)].contiguous()


def summed_slice(x: torch.Tensor, dim: int, pg: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice of ``dim`` of the sum of every rank's ``x``."""
    if not native(pg):
        return this_slice(all_reduced(x, pg), dim, pg)
    out: torch.Tensor = funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, pg)
    return out


class CopyIn(torch.autograd.Function):
    """``x`` unchanged; its gradient summed over the group."""

    @staticmethod
    def forward(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return all_reduced(grad, ctx.pg), None


class SumOut(torch.autograd.Function):
    """The sum of every rank's partial ``x``; its gradient copied."""

    @staticmethod
    def forward(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return all_reduced(x, pg)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _OnDim(torch.autograd.Function):
    """A collective on ``dim`` of ``x`` over ``pg``: the context both ways keep."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.dim, ctx.pg = inputs[1], inputs[2]


class Gather(_OnDim):
    """Every rank's slice of ``dim`` concatenated; the gradient's slice back."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, pg: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return gathered(x, dim, pg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return this_slice(grad, ctx.dim, ctx.pg), None, None


class _GatheredBack(_OnDim):
    """A slice of ``dim`` forward, whose gradient is gathered back."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return gathered(grad, ctx.dim, ctx.pg), None, None


class KeepSlice(_GatheredBack):
    """This rank's slice of a replicated ``x``; the gradient gathered."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, pg: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return this_slice(x, dim, pg)


class SumScatter(_GatheredBack):
    """This rank's slice of the sum of every rank's partial ``x``; the gradient gathered."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, pg: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return summed_slice(x, dim, pg)
