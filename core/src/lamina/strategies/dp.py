"""Data parallelism planned from the static graph (``lamina.distribute(model, "dp")``).

Unlike torch DDP, which learns bucket order during the first iteration and rebuilds, the
bucket plan here comes from the captured forward graph before the first backward: the
order parameters are first used gives the order their gradients become ready. The
graph and bucket plan become an :class:`~lamina.runtime.ExecutionPlan`; every rank
verifies that it matches the others' before the first collective (the wrap-time
broadcast), and the reducer, codecs and compiled forward run from its nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.comm.buckets import MIB, BucketPlan, ParamSpec, auto_bucket_cap, plan_buckets
from lamina.comm.codecs import Codec, get_codec, self_check
from lamina.comm.reducer import GradientReducer
from lamina.device.handle import DeviceHandle
from lamina.errors import ConfigError
from lamina.graph import CAPTURE_METHODS, CapturedGraph, capture
from lamina.runtime import ExecutionPlan, RunLog
from lamina.runtime import build_dp as plan_dp
from lamina.runtime.compiled import CompiledForward, compile_backend_of
from lamina.strategies.coalesced import dtype_totals, run_broadcast_nodes
from lamina.strategies.preflight import before_first_collective
from lamina.verify import PreflightReport


class DataParallel(nn.Module):
    """Wraps ``module``: same forward, gradients averaged across the data-parallel group.

    ``bucket_cap_mb=None`` sizes buckets automatically (gradient bytes / 8, clamped to
    1..25 MiB) so that communication overlaps backward; a number fixes the cap.
    Parameters and buffers are broadcast from the group's first rank at wrap time, and
    buffers again before every training forward (as torch DDP does), so every rank
    holds the same model. The wrapped module's ``parameters()`` go to a stock optimizer.

    ``codec`` (``"bf16"``, ``"fp16"`` or a :class:`~lamina.comm.codecs.Codec`) compresses
    fp32 buckets on the wire; ``compile`` (``True`` or a ``torch.compile`` backend name)
    runs the forward compiled; ``capture_methods`` limits the graph capture paths;
    ``verify=False`` skips the pre-flight cross-rank check. Each optional path has a
    declared fallback in :attr:`execution_plan`; :meth:`step_summary` shows those taken.
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
        codec: str | Codec | None = None,
        compile: bool | str = False,
        capture_methods: tuple[str, ...] = CAPTURE_METHODS,
        verify: bool = True,
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
        self._codec = get_codec(codec)
        self._compile_backend = compile_backend_of(compile)
        self._capture_methods = capture_methods
        self._verify = verify
        self._source = dist.get_global_rank(group, 0) if group is not None else 0
        self.graph: CapturedGraph | None = None
        self.plan: BucketPlan | None = None
        self.execution_plan: ExecutionPlan | None = None
        self.run_log: RunLog | None = None
        self.preflight: PreflightReport | None = None
        self.reducer: GradientReducer | None = None
        self._forward: CompiledForward | None = None
        if example_inputs is not None or example_kwargs is not None:
            self.prepare(example_inputs or (), example_kwargs or {})

    # -- planning ------------------------------------------------------------------------
    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BucketPlan:
        """Capture the graph from example inputs, plan the step, verify the plan across
        ranks, broadcast rank 0's state and install the reducer."""
        if self.plan is not None:
            return self.plan
        self.graph = capture(self.module, args, kwargs, methods=self._capture_methods)  # type: ignore[arg-type]
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
        execution = self._build_execution_plan(self.plan)
        self.preflight = before_first_collective(
            execution, self.module, verify=self._verify, graph=self.graph
        )
        self.execution_plan, self.run_log = execution, RunLog(execution)
        self._broadcast_state("setup")
        self.reducer = GradientReducer(
            self.plan,
            named,
            self.group,
            self.handle,
            bucket_nodes=[plan_dp.bucket_node(b.index) for b in self.plan.buckets],
            codecs=self._bucket_codecs(execution),
            excluded_node=plan_dp.EXCLUDED,
            observer=self.run_log,
        )
        if self._compile_backend is not None:
            self._forward = CompiledForward(
                self.module, self._compile_backend, self.run_log, plan_dp.FORWARD
            )
        return self.plan

    def _build_execution_plan(self, buckets: BucketPlan) -> ExecutionPlan:
        assert self.graph is not None
        from lamina.session import current

        runtime = current()
        device = next(self.module.parameters()).device
        checks = {}
        if self._codec is not None:
            for dtype in {b.dtype for b in buckets.buckets}:
                checks[dtype] = self_check(self._codec, getattr(torch, dtype), device)
        return plan_dp.build_dp_plan(
            plan_dp.DPPlanInputs(
                graph=self.graph,
                buckets=buckets,
                group=tuple(dist.get_process_group_ranks(self.group or dist.group.WORLD)),
                backend=runtime.backend.name if runtime is not None else "unknown",
                pg_backend=str(dist.get_backend(self.group)),
                setup_state=dtype_totals([*self.module.parameters(), *self.module.buffers()]),
                step_buffers=dtype_totals(list(self.module.buffers()))
                if self.broadcast_buffers
                else [],
                codec=self._codec,
                codec_checks=checks,
                compile_backend=self._compile_backend,
            )
        )

    def _bucket_codecs(self, execution: ExecutionPlan) -> dict[int, Codec]:
        if self._codec is None or execution.world_size == 1:
            return {}
        return {
            b.index: self._codec
            for b in (self.plan.buckets if self.plan is not None else ())
            if execution.node(plan_dp.bucket_node(b.index)).attr("codec") != "none"
        }

    def step_summary(self) -> str:
        """One line: collectives of the last step and every fallback taken."""
        if self.run_log is None:
            return "not planned yet (no forward so far)"
        return self.run_log.summary()

    # -- running -------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; the first call plans if no example was given."""
        if self.plan is None:
            self.prepare(args, kwargs)
        assert self.execution_plan is not None and self.run_log is not None
        if self.module.training and torch.is_grad_enabled():
            self.run_log.begin_step()
            if self.broadcast_buffers:
                self._broadcast_state("forward")
        with self.run_log.compute("forward"):
            if self._forward is not None:
                return self._forward(*args, **kwargs)
            return self.module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the (already averaged) gradients."""
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the next one outside synchronizes."""
        if self.reducer is None:
            raise ConfigError(
                "no_sync() before the first forward: nothing is planned yet; run one forward "
                "first or pass example_inputs to lamina.distribute()"
            )
        with self.reducer.no_sync():
            yield

    def _broadcast_state(self, phase: str) -> None:
        """The plan's broadcasts of ``phase``: parameters and buffers at setup, buffers
        before each training forward."""
        assert self.run_log is not None
        tensors = list(self.module.buffers())
        if phase == "setup":
            tensors = [*self.module.parameters(), *tensors]
        run_broadcast_nodes(self.run_log, phase, tensors, self._source, self.group)
