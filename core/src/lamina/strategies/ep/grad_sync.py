"""Expert parallelism's gradients after backward: :class:`ExpertGradientSync`.

Every rank of the ep axis trains on its own batch. A dense parameter is whole on each
of them, so its gradient is averaged over the ep axis (and any replica axes), one
all-reduce per dtype. An expert is held by one rank of the axis and its gradient already
sums every rank's tokens (the dispatch's backward brought them back), so it is divided
by the ep degree instead, and averaged over the replica axes only. Composed with a
sharder over the other axes, this runs on the sharder's gradient shards after its
reduce-scatters have finished (it is queued behind them at the end of backward).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lamina.dtypes import dtype_name
from lamina.strategies.ep.dispatch import Issuing
from lamina.strategies.surface import PIPELINE_KEY


def dense_node(dtype: str) -> str:
    """Plan node id of the dense gradients' all-reduce of ``dtype``."""
    return f"gradients.dense.{dtype}"


def expert_node(dtype: str) -> str:
    """Plan node id of the experts' gradients' all-reduce over the replica axes."""
    return f"gradients.experts.{dtype}"


@dataclass
class SyncGroup:
    """A group gradients are averaged over (None: the default group) and its size."""

    group: dist.ProcessGroup | None
    size: int


@dataclass
class ExpertGradientSync:
    """See the module: ``experts`` names the expert parameters, ``dense`` and ``replicas``
    the groups the others and they are averaged over, ``ep`` the degree."""

    model: weakref.ref[nn.Module]
    experts: frozenset[str]
    ep: int
    dense: SyncGroup
    replicas: SyncGroup
    issuing: Issuing
    queued: bool = field(default=False)

    def queue(self) -> None:
        """Run :meth:`run` when autograd finishes this backward, after every callback
        queued so far (a sharder's end of backward): once per backward; under a pipeline,
        which runs many backwards a step, its engine runs :meth:`run` at the step's end."""
        model = self.model()
        if self.queued or model is None or PIPELINE_KEY in model.__dict__:
            return  # a pipeline runs it once per step (STEP_SYNCS_KEY)
        self.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._behind)

    def _behind(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.run)

    def run(self) -> None:
        """Average the gradients (see the module), at the end of a backward."""
        self._sync(in_backward=True)

    def run_after_step(self) -> None:
        """Average the gradients after a pipelined step's backwards have all ended."""
        self._sync(in_backward=False)

    def _sync(self, in_backward: bool) -> None:
        self.queued = False
        model = self.model()
        if model is None:
            return
        dense: dict[torch.dtype, list[nn.Parameter]] = {}
        experts: dict[torch.dtype, list[nn.Parameter]] = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if name in self.experts:
                if p.grad is not None:
                    _local(p.grad).div_(self.ep)
                experts.setdefault(p.dtype, []).append(p)
            else:
                dense.setdefault(p.dtype, []).append(p)
        self._average(dense, self.dense, dense_node, in_backward)
        self._average(experts, self.replicas, expert_node, in_backward)

    def _average(
        self,
        by_dtype: dict[torch.dtype, list[nn.Parameter]],
        over: SyncGroup,
        node: Callable[[str], str],
        in_backward: bool,
    ) -> None:
        if over.size == 1:
            return
        for dtype, params in sorted(by_dtype.items(), key=lambda item: str(item[0])):
            grads = [_grad_of(p) for p in params]
            flat = torch.cat([_local(g).reshape(-1) for g in grads])
            name = dtype_name(dtype)
            nbytes = flat.numel() * flat.element_size()
            with self.issuing(node(name), "all_reduce", nbytes, in_backward):
                dist.all_reduce(flat, group=over.group)
            flat /= over.size
            offset = 0
            for g in grads:
                local = _local(g)
                local.copy_(flat[offset : offset + local.numel()].view_as(local))
                offset += local.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _grad_of(p: nn.Parameter) -> torch.Tensor:
    """``p``'s gradient; zeros when this rank's backward gave it none (the all-reduce
    has the same size on every rank)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


__all__ = ["ExpertGradientSync", "SyncGroup", "dense_node", "expert_node"]
