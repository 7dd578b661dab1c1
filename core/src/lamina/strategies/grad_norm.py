"""The gradient norm of a distributed model, read from its placement: one implementation
for every strategy and composition (:func:`clip_grad_norm`).

Each rank holds pieces of the model's gradients: whole ones, tensor-parallel slices,
ZeRO-3 row shards, its pipeline stages' parameters. A piece held by ``c`` ranks
(:meth:`~lamina.runtime.placement.ParameterPlacement.copies`: replicas, tp ranks of a
parameter tp leaves whole, the stages sharing a tied weight) adds ``|g|^p / c`` on each of
them, so one sum over the job counts every element of the model once, as
``torch.nn.utils.clip_grad_norm_`` counts it in one process. The infinity norm takes the
maximum instead. Where no role splits, shards or pipelines (``dp``), every rank already
holds every gradient and no collective runs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from lamina.errors import ConfigError
from lamina.runtime.placement import ModelPlacement


def local_piece(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (a sharded parameter's gradient), else the tensor."""
    local: torch.Tensor = getattr(tensor, "_local_tensor", tensor)
    return local


def grad_norm(model: nn.Module, placement: ModelPlacement, norm_type: float = 2.0) -> torch.Tensor:
    """The whole model's gradient norm of order ``norm_type`` (a float32 scalar, the same
    on every rank). Collective over the job where the placement spans pieces."""
    p = _checked_order(norm_type)
    device = next((q.device for q in model.parameters()), torch.device("cpu"))
    pieces = [
        (name, local_piece(q.grad).detach())
        for name, q in model.named_parameters()
        if q.grad is not None
    ]
    if math.isinf(p):
        total = torch.zeros((), dtype=torch.float32, device=device)
        for _, grad in pieces:
            if grad.numel():
                total = torch.maximum(total, grad.abs().max().float())
        if placement.spans_pieces() and dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    across = placement.spans_pieces() and dist.is_initialized()
    powered = torch.zeros((), dtype=torch.float32, device=device)
    for name, grad in pieces:
        norm = torch.linalg.vector_norm(grad, p, dtype=torch.float32).pow(p)
        powered += norm / placement.copies(name) if across else norm
    if across:
        dist.all_reduce(powered)
    return powered.pow(1.0 / p)


def clip_grad_norm(
    model: nn.Module,
    placement: ModelPlacement,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a distributed model: every gradient piece
    scaled by ``max_norm / (norm + 1e-6)`` (at most 1), where ``norm`` is the whole
    model's (:func:`grad_norm`); returns that norm. ``error_if_nonfinite``: a
    RuntimeError, on every rank, when the norm is NaN or infinite (nothing scaled)."""
    total = grad_norm(model, placement, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the gradient norm of order {norm_type} is {total.item()}, so the gradients "
            "cannot be clipped; find the non-finite gradient, or pass "
            "error_if_nonfinite=False to scale by it anyway"
        )
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for q in model.parameters():
        if q.grad is not None:
            grad = local_piece(q.grad)
            grad.mul_(scale.to(device=grad.device, dtype=grad.dtype))
    return total


def _checked_order(norm_type: float) -> float:
    p = float(norm_type)
    if not (p > 0 or math.isinf(p)) or p == -math.inf:
        raise ConfigError(
            f"clip_grad_norm_: norm_type={norm_type!r} is not a norm lamina computes across "
            "ranks; pass a positive order (2.0 for the Euclidean norm) or float('inf')"
        )
    return p
