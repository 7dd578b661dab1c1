"""Data parallelism planned from the static graph (``lamina.distribute(model, "dp")``).

Unlike torch DDP, which learns bucket order during the first iteration and rebuilds, the
bucket plan here comes from the captured forward graph before the first backward: the
order parameters are first used gives the order their gradients become ready.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.comm.buckets import MIB, BucketPlan, ParamSpec, auto_bucket_cap, plan_buckets
from lamina.comm.reducer import GradientReducer
from lamina.device.handle import DeviceHandle
from lamina.errors import ConfigError
from lamina.graph import CapturedGraph, capture


class DataParallel(nn.Module):
    """Wraps ``module``: same forward, gradients averaged across the data-parallel group.

    ``bucket_cap_mb=None`` sizes buckets automatically (gradient bytes / 8, clamped to
    1..25 MiB) so that communication overlaps backward; a number fixes the cap.
    Parameters and buffers are broadcast from the group's first rank at wrap time, and
    buffers again before every training forward (as torch DDP does), so every rank
    holds the same model. The wrapped module's ``parameters()`` go to a stock optimizer.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        handle: DeviceHandle | None = None,
        example_inputs: tuple[Any, ...] | None = None,
        example_kwargs: dict[str, Any] | None = None,
        bucket_cap_mb: float | None = None,
        first_bucket_mb: float = 1.0,
        alignment_bytes: int = 512,
        broadcast_buffers: bool = True,
        strict: bool = False,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ConfigError(
                "DataParallel needs torch.distributed; call lamina.init() before distribute()"
            )
        if (bucket_cap_mb is not None and bucket_cap_mb <= 0) or first_bucket_mb <= 0:
            raise ConfigError(
                f"bucket_cap_mb and first_bucket_mb must be > 0, got {bucket_cap_mb} and "
                f"{first_bucket_mb}"
            )
        self.module = module
        self.group = group
        self.handle = handle
        self.broadcast_buffers = broadcast_buffers
        self._cap_bytes = None if bucket_cap_mb is None else int(bucket_cap_mb * MIB)
        self._first_bytes = int(first_bucket_mb * MIB)
        self._alignment = alignment_bytes
        self._strict = strict
        self._source = dist.get_global_rank(group, 0) if group is not None else 0
        self.graph: CapturedGraph | None = None
        self.plan: BucketPlan | None = None
        self.reducer: GradientReducer | None = None
        self._broadcast(list(module.parameters()) + list(module.buffers()))
        if example_inputs is not None or example_kwargs is not None:
            self.prepare(example_inputs or (), example_kwargs or {})

    # -- planning ------------------------------------------------------------------------
    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BucketPlan:
        """Capture the graph from example inputs, plan the buckets and install the reducer."""
        if self.plan is not None:
            return self.plan
        self.graph = capture(self.module, args, kwargs)
        named = dict(self.module.named_parameters())
        specs = [
            ParamSpec(name, tuple(named[name].shape), named[name].dtype)
            for name in self.graph.param_names
        ]
        unused = set(self.graph.unused)
        cap = self._cap_bytes or auto_bucket_cap([p for p in specs if p.name not in unused])
        self.plan = plan_buckets(
            specs,
            self.graph.grad_ready_order(),
            cap_bytes=cap,
            first_bucket_bytes=self._first_bytes,
            alignment_bytes=self._alignment,
            unused=self.graph.unused,
            strict=self._strict,
        )
        self.reducer = GradientReducer(self.plan, named, self.group, self.handle)
        return self.plan

    # -- running -------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; the first call plans if no example was given."""
        if self.plan is None:
            self.prepare(args, kwargs)
        if self.broadcast_buffers and self.module.training and torch.is_grad_enabled():
            self._broadcast(list(self.module.buffers()))
        return self.module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the (already averaged) gradients."""
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the next one outside synchronizes."""
        if self.reducer is None:
            raise ConfigError("no_sync() before the first forward: nothing is planned yet")
        with self.reducer.no_sync():
            yield

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        if dist.get_world_size(self.group) == 1:
            return
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor.data, src=self._source, group=self.group)
