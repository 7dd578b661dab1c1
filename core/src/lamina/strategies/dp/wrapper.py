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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.buckets import (
    MIB,
    BucketPlan,
    ParamSpec,
    auto_bucket_cap,
    plan_buckets,
    ring_all_reduce_cost,
)
from lamina.comm.codecs import Codec, get_codec, self_check
from lamina.comm.cost import (
    ALGORITHMS,
    AlgorithmChoice,
    CostModel,
    choose_algorithm,
    unavailable_algorithms,
)
from lamina.comm.fp8 import Fp8Channel
from lamina.comm.reducer import GradientReducer
from lamina.errors import ConfigError
from lamina.graph import CapturedGraph, capture
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.coalesced import dtype_totals, run_broadcast_nodes
from lamina.strategies.contract import Placement, PlannedStep
from lamina.strategies.dp import plan as plan_dp
from lamina.strategies.dp.compiled import CompiledForward, compile_backend_of
from lamina.strategies.dp.options import DataParallelOptions
from lamina.strategies.preflight import before_first_collective
from lamina.verify import PreflightReport

if TYPE_CHECKING:
    from lamina.session import Runtime


class DataParallel(nn.Module):
    """Wraps ``module``: same forward, gradients averaged across the data-parallel group.

    The group is the one ``placement`` replicates over on ``runtime.mesh`` (every axis by
    default: the whole job). Options are :class:`DataParallelOptions`. Parameters and
    buffers are broadcast from the first rank at wrap time, and buffers again before every
    training forward (as torch DDP does), so every rank holds the same model. The wrapped
    module's ``parameters()`` go to a stock optimizer. Each optional path has a declared
    fallback in :attr:`execution_plan`; :meth:`step_summary` shows those taken.
    """

    def __init__(
        self,
        module: nn.Module,
        runtime: Runtime,
        placement: Placement | None = None,
        options: DataParallelOptions | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ConfigError(
                "DataParallel needs torch.distributed; call lamina.init() before distribute()"
            )
        options = options or DataParallelOptions()
        placement = placement or Placement(replicate=runtime.mesh.axis_names)
        self.module = module
        self.runtime = runtime
        self.options = options
        self.placement = placement
        self.group, self._ranks = runtime.mesh.group_over(placement.replicate)
        self._axis = runtime.mesh.axes_label(placement.replicate)
        self.handle = runtime.handle
        self.broadcast_buffers = options.broadcast_buffers
        cap = options.bucket_cap_mb
        self._cap_bytes = None if cap is None else int(cap * MIB)
        first = options.first_bucket_mb
        self._first_bytes = None if first is None else int(first * MIB)
        codec = get_codec(options.codec)
        self._codec = codec.on_backend(runtime.kernels) if codec is not None else None
        self._compile_backend = compile_backend_of(options.compile)
        self._source = self._ranks[0]
        self.graph: CapturedGraph | None = None
        self.plan: BucketPlan | None = None
        self.execution_plan: ExecutionPlan | None = None
        self.run_log: RunLog | None = None
        self.preflight: PreflightReport | None = None
        self.reducer: GradientReducer | None = None
        self.algorithm_groups: AlgorithmGroups | None = None
        self._cost_model: CostModel | None = None
        self._choices: dict[int, AlgorithmChoice] = {}
        self._forward: CompiledForward | None = None
        if options.example_inputs is not None or options.example_kwargs is not None:
            self.prepare(options.example_inputs or (), options.example_kwargs or {})

    # -- planning ------------------------------------------------------------------------
    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BucketPlan:
        """Capture the graph from example inputs, plan the step, verify the plan across
        ranks, broadcast rank 0's state and install the reducer."""
        if self.plan is not None:
            return self.plan
        methods = self.options.capture_methods
        self.graph = capture(self.module, args, kwargs, methods=methods)  # type: ignore[arg-type]
        named = dict(self.module.named_parameters())
        specs = [
            ParamSpec(name, tuple(named[name].shape), named[name].dtype)
            for name in self.graph.param_names
        ]
        unused = set(self.graph.unused)
        if len(self._ranks) > 1:
            self._cost_model = CostModel.from_topology(self.runtime.topology, self._ranks)
        alpha, beta = self._bucket_latency(self._cost_model)
        cap = self._cap_bytes or auto_bucket_cap(
            [p for p in specs if p.name not in unused], alpha_s=alpha, beta_s_per_byte=beta
        )
        self.plan = plan_buckets(
            specs,
            self.graph.grad_ready_order(),
            cap_bytes=cap,
            first_bucket_bytes=self._first_bytes,
            alignment_bytes=self.options.alignment_bytes,
            unused=self.graph.unused,
            strict=self.options.strict,
            alpha_s=alpha,
            beta_s_per_byte=beta,
        )
        self._choices = self._choose_algorithms(self.plan)
        execution = self._build_execution_plan(self.plan)
        planned = PlannedStep(execution, (("graph", plan_dp.graph_lines(self.graph)),))
        self.preflight = before_first_collective(
            self.runtime, planned, self.module, verify=self.options.verify
        )
        self.execution_plan, self.run_log = execution, RunLog(execution)
        self._broadcast_state("setup")
        self.algorithm_groups = self._algorithm_groups(execution)
        self.reducer = GradientReducer(
            self.plan,
            named,
            self.group,
            self.handle,
            bucket_nodes=[plan_dp.bucket_node(b.index) for b in self.plan.buckets],
            codecs=self._bucket_codecs(execution),
            excluded_node=plan_dp.EXCLUDED,
            observer=self.run_log,
            algorithms=self._bucket_algorithms(execution),
            algorithm_groups=self.algorithm_groups,
            codec_scope=self.options.codec_scope,
            fp8_channel=self._fp8_channel(execution),
        )
        if self._compile_backend is not None:
            self._forward = CompiledForward(
                self.module, self._compile_backend, self.run_log, plan_dp.FORWARD
            )
        return self.plan

    def _build_execution_plan(self, buckets: BucketPlan) -> ExecutionPlan:
        assert self.graph is not None
        device = next(self.module.parameters()).device
        checks = {}
        if self._codec is not None:
            for dtype in {b.dtype for b in buckets.buckets}:
                checks[dtype] = self_check(self._codec, getattr(torch, dtype), device)
        return plan_dp.build_dp_plan(
            plan_dp.DPPlanInputs(
                graph=self.graph,
                buckets=buckets,
                group=self._ranks,
                backend=self.runtime.backend.name,
                pg_backend=self._pg_backend(),
                setup_state=dtype_totals([*self.module.parameters(), *self.module.buffers()]),
                step_buffers=dtype_totals(list(self.module.buffers()))
                if self.broadcast_buffers
                else [],
                codec=self._codec,
                codec_checks=checks,
                compile_backend=self._compile_backend,
                axis=self._axis,
                algorithms=self._choices,
                cost_model=self._cost_model.describe() if self._cost_model else "",
                codec_scope=self.options.codec_scope,
                ranks_per_host=self._cost_model.layout.per_host if self._cost_model else 1,
            )
        )

    # -- all-reduce algorithms -------------------------------------------------------------
    def _whole_job(self) -> bool:
        return len(self._ranks) == dist.get_world_size()

    def _bucket_latency(self, model: CostModel | None) -> tuple[float, float]:
        """alpha and beta of the group's all-reduce for the bucket planner, from the cost
        model of measured links (its best algorithm at 1 byte and at 64 MiB); without
        measured links (or one rank), the planner's defaults (measured for gloo on 2
        ranks of one host) scaled to the group's size as a ring scales them."""
        if model is None or model.source == "topology":  # estimates, not measurements
            return ring_all_reduce_cost(len(self._ranks))
        unavailable = unavailable_algorithms(model.layout, self._pg_backend(), self._whole_job())
        runnable = [a for a in ALGORITHMS if a not in unavailable]
        large = 64 * MIB
        alpha = model.choose(1, runnable).seconds
        beta = (model.choose(large, runnable).seconds - alpha) / large
        return alpha, max(beta, 1e-15)

    def _choose_algorithms(self, buckets: BucketPlan) -> dict[int, AlgorithmChoice]:
        """Each bucket's all-reduce algorithm, from the cost model of the group's links."""
        model = self._cost_model
        if len(self._ranks) == 1 or model is None:
            return {}
        unavailable = unavailable_algorithms(model.layout, self._pg_backend(), self._whole_job())
        requested = self.options.algorithm
        choices = {}
        for b in buckets.buckets:
            excluded = unavailable
            if self._two_phase(b.dtype):
                if self.options.codec_scope == "all":
                    continue  # the two-phase sum over the whole group is its algorithm
                if "hierarchical" not in unavailable:  # "inter": keep an inter-host phase
                    why = "codec_scope='inter' compresses an inter-host phase"
                    excluded = {**unavailable, "flat": why, "ordered": why}
            choices[b.index] = choose_algorithm(model, b.nbytes, requested, excluded)
        return choices

    def _two_phase(self, dtype: str) -> bool:
        """Whether the codec sums buckets of ``dtype`` in two phases."""
        codec = self._codec
        return codec is not None and codec.two_phase and codec.applies_to(getattr(torch, dtype))

    def _fp8_channel(self, execution: ExecutionPlan) -> Fp8Channel | None:
        """The process group (and gloo thread) of the fp8 sums over the whole group, when
        the plan has any (built after pre-flight agreed on the plan, like the groups of
        the algorithms)."""
        if self.options.codec_scope != "all" or execution.world_size == 1:
            return None
        if not any(n.attr("codec") == "fp8" for n in execution.collectives()):
            return None
        return Fp8Channel(self._ranks, self._pg_backend())

    def _pg_backend(self) -> str:
        return str(dist.get_backend(self.group))

    def _bucket_algorithms(self, execution: ExecutionPlan) -> dict[int, tuple[str, int]]:
        """The algorithm and chunk count the plan gives each bucket."""
        out = {}
        for b in self.plan.buckets if self.plan is not None else ():
            if execution.world_size == 1:
                continue
            node = execution.node(plan_dp.bucket_node(b.index))
            out[b.index] = (node.attr("algorithm", "flat"), int(node.attr("chunks", "1")))
        return out

    def _algorithm_groups(self, execution: ExecutionPlan) -> AlgorithmGroups | None:
        """The process groups of the plan's algorithms (built after pre-flight agreed on
        the plan: every rank builds the same groups in the same order)."""
        used = {name for name, _ in self._bucket_algorithms(execution).values()}
        if used <= {"flat"} or self._cost_model is None:
            return None
        return AlgorithmGroups(
            self._cost_model.layout,
            dist.get_rank(),
            flat=self.group,
            pg_backend=self._pg_backend(),
            whole_job=self._whole_job(),
            needed=used,
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
