"""What a model distributed with ``dp`` carries besides its own state (``model.lamina_dp``).

:class:`DataParallelState` plans the step from the captured forward graph, before the
first backward: the order parameters are first used gives the order their gradients
become ready, which orders the buckets (torch DDP learns it during the first iteration
and rebuilds). The graph and bucket plan become an :class:`~lamina.runtime.ExecutionPlan`;
every rank verifies that it matches the others' before the first collective (the setup
broadcast), and the reducer, codecs and compiled forward run from its nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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
from lamina.comm.codecs import Codec, self_check
from lamina.comm.cost import ALGORITHMS, AlgorithmChoice, CostModel, unavailable_algorithms
from lamina.comm.reducer import GradientReducer
from lamina.comm.two_phase import TwoPhaseChannel
from lamina.graph import CapturedGraph, capture
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.algorithm_choice import choose_algorithms, group_cost_model
from lamina.strategies.coalesced import dtype_totals, run_broadcast_nodes
from lamina.strategies.codec_registry import resolve_codec
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import (
    Placement,
    PlanAndBuild,
    PlannedStep,
    SetupBroadcast,
    StepInputs,
)
from lamina.strategies.dp import plan as plan_dp
from lamina.strategies.dp.compiled import CompiledForward, compile_backend_of
from lamina.strategies.dp.options import DataParallelOptions
from lamina.verify import PreflightReport

#: The model's own forward (the class's before ``dp`` extended it), bound to the model.
Forward = Callable[..., Any]


@dataclass(frozen=True)
class PlannedBuckets:
    """What :meth:`DataParallelState.install` builds on besides the execution plan."""

    graph: CapturedGraph
    buckets: BucketPlan


class DataParallelState:
    """The data-parallel group, options and (once planned) the graph, bucket plan,
    execution plan, run log, pre-flight report and reducer of one model.

    The group is the one ``placement`` replicates over on ``ctx.mesh``. Nothing is
    planned and no collective runs until ``plan_and_build`` (lamina.distribute's plan,
    verify, broadcast and build sequence) runs, at the first forward that records
    gradients or at wrap time from ``example_inputs``: :meth:`plan_step` plans,
    :meth:`install` builds.
    """

    def __init__(
        self,
        ctx: StrategyContext,
        placement: Placement,
        options: DataParallelOptions,
        model_class: type[nn.Module],
        plan_and_build: PlanAndBuild,
    ) -> None:
        self.ctx = ctx
        #: lamina.distribute's sequence, run once at the first forward with gradients.
        self.plan_and_build = plan_and_build
        #: The model's class before ``dp`` extended it.
        self.model_class = model_class
        self.options = options
        self.placement = placement
        self.group, self.ranks = ctx.mesh.group_over(placement.replicate)
        self.axis = ctx.mesh.axes_label(placement.replicate)
        self.handle = ctx.handle
        self.broadcast_buffers = options.broadcast_buffers
        cap = options.bucket_cap_mb
        self._cap_bytes = None if cap is None else int(cap * MIB)
        first = options.first_bucket_mb
        self._first_bytes = None if first is None else int(first * MIB)
        codec = resolve_codec(options.codec)
        self.codec = codec.on_backend(ctx.kernels) if codec is not None else None
        self.compile_backend = compile_backend_of(options.compile)
        self.source = self.ranks[0]
        self.graph: CapturedGraph | None = None
        self.plan: BucketPlan | None = None
        self.execution_plan: ExecutionPlan | None = None
        self.run_log: RunLog | None = None
        self.preflight: PreflightReport | None = None
        self.reducer: GradientReducer | None = None
        self.algorithm_groups: AlgorithmGroups | None = None
        #: The compiled forward (``compile=``), once planned.
        self.compiled: CompiledForward | None = None
        #: False inside ``no_sync()``: backward passes accumulate locally.
        self.sync_enabled = True
        self._cost_model: CostModel | None = None
        self._choices: dict[int, AlgorithmChoice] = {}

    # -- planning ------------------------------------------------------------------------
    def plan_step(self, module: nn.Module, inputs: StepInputs) -> PlannedStep:
        """Capture the graph of ``module`` (seen as its own class) from ``inputs`` and
        plan the step: buckets, each bucket's algorithm and codec, the execution plan,
        the setup broadcast of the first rank's state. No collective."""
        methods = self.options.capture_methods
        with seen_as(module, self.model_class):
            graph = capture(module, inputs.args, dict(inputs.kwargs), methods=methods)  # type: ignore[arg-type]
        named = dict(module.named_parameters())
        specs = [
            ParamSpec(name, tuple(named[name].shape), named[name].dtype)
            for name in graph.param_names
        ]
        unused = set(graph.unused)
        self._cost_model = group_cost_model(self.ctx.topology, self.ranks)
        alpha, beta = self._bucket_latency(self._cost_model)
        cap = self._cap_bytes or auto_bucket_cap(
            [p for p in specs if p.name not in unused], alpha_s=alpha, beta_s_per_byte=beta
        )
        buckets = plan_buckets(
            specs,
            graph.grad_ready_order(),
            cap_bytes=cap,
            first_bucket_bytes=self._first_bytes,
            alignment_bytes=self.options.alignment_bytes,
            unused=graph.unused,
            strict=self.options.strict,
            alpha_s=alpha,
            beta_s_per_byte=beta,
        )
        self._choices = self._choose_algorithms(buckets)
        execution = self._build_execution_plan(module, graph, buckets)
        setup = SetupBroadcast((*module.parameters(), *module.buffers()), self.source, self.group)
        return PlannedStep(
            module,
            execution,
            (("graph", plan_dp.graph_lines(graph)),),
            setup,
            PlannedBuckets(graph, buckets),
        )

    def install(self, module: nn.Module, planned: PlannedStep) -> None:
        """Build the step ``planned`` describes (verified and set up by lamina): the
        algorithms' groups, the reducer over the plan's buckets, the compiled forward."""
        built = planned.inputs
        assert isinstance(built, PlannedBuckets)
        execution = planned.plan
        self.graph, self.plan = built.graph, built.buckets
        buckets = plan_dp.bucket_plan_of(execution, built.buckets)  # what runs: the plan's
        self.execution_plan, self.run_log = execution, planned.log()
        self.preflight = planned.preflight
        self.algorithm_groups = self._algorithm_groups(execution, buckets)
        self.reducer = GradientReducer(
            buckets,
            dict(module.named_parameters()),
            self.group,
            self.handle,
            bucket_nodes=[plan_dp.bucket_node(b.index) for b in buckets.buckets],
            codecs=self._bucket_codecs(execution, buckets),
            excluded_node=plan_dp.EXCLUDED,
            observer=self.run_log,
            algorithms=self._bucket_algorithms(execution, buckets),
            algorithm_groups=self.algorithm_groups,
            codec_scope=self.options.codec_scope,
            channel=self._two_phase_channel(execution),
        )
        self.reducer.sync_enabled = self.sync_enabled  # planned inside no_sync(): stays off
        if self.compile_backend is not None:
            forward = self.model_class.forward.__get__(module)  # the model's own forward
            self.compiled = CompiledForward(
                module, forward, self.compile_backend, self.run_log, plan_dp.FORWARD
            )

    def _build_execution_plan(
        self, module: nn.Module, graph: CapturedGraph, buckets: BucketPlan
    ) -> ExecutionPlan:
        device = next(module.parameters()).device
        checks = {}
        if self.codec is not None:
            for dtype in {b.dtype for b in buckets.buckets}:
                checks[dtype] = self_check(self.codec, getattr(torch, dtype), device)
        return plan_dp.build_dp_plan(
            plan_dp.DPPlanInputs(
                graph=graph,
                buckets=buckets,
                group=self.ranks,
                backend=self.ctx.backend.name,
                pg_backend=self._pg_backend(),
                setup_state=dtype_totals([*module.parameters(), *module.buffers()]),
                step_buffers=dtype_totals(list(module.buffers())) if self.broadcast_buffers else [],
                codec=self.codec,
                codec_checks=checks,
                compile_backend=self.compile_backend,
                axis=self.axis,
                algorithms=self._choices,
                cost_model=self._cost_model.describe() if self._cost_model else "",
                codec_scope=self.options.codec_scope,
                ranks_per_host=self._cost_model.layout.per_host if self._cost_model else 1,
            )
        )

    # -- all-reduce algorithms -------------------------------------------------------------
    def _whole_job(self) -> bool:
        return len(self.ranks) == dist.get_world_size()

    def _bucket_latency(self, model: CostModel | None) -> tuple[float, float]:
        """alpha and beta of the group's all-reduce for the bucket planner, from the cost
        model of measured links (its best algorithm at 1 byte and at 64 MiB); without
        measured links (or one rank), the planner's defaults (measured for gloo on 2
        ranks of one host) scaled to the group's size as a ring scales them."""
        if model is None or model.source == "topology":  # estimates, not measurements
            return ring_all_reduce_cost(len(self.ranks))
        unavailable = unavailable_algorithms(model.layout, self._pg_backend(), self._whole_job())
        runnable = [a for a in ALGORITHMS if a not in unavailable]
        large = 64 * MIB
        alpha = model.choose(1, runnable).seconds
        beta = (model.choose(large, runnable).seconds - alpha) / large
        return alpha, max(beta, 1e-15)

    def _choose_algorithms(self, buckets: BucketPlan) -> dict[int, AlgorithmChoice]:
        """Each bucket's all-reduce algorithm, from the cost model of the group's links."""

        def exclusions(index: int, unavailable: dict[str, str]) -> dict[str, str] | None:
            if not self._two_phase(buckets.buckets[index].dtype):
                return unavailable
            if self.options.codec_scope == "all":
                return None  # the two-phase sum over the whole group is its algorithm
            if "hierarchical" in unavailable:
                return unavailable
            why = "codec_scope='inter' compresses an inter-host phase"  # keep that phase
            return {**unavailable, "flat": why, "ordered": why}

        return choose_algorithms(
            self._cost_model,
            {b.index: b.nbytes for b in buckets.buckets},
            self.options.algorithm,
            pg_backend=self._pg_backend(),
            whole_job=self._whole_job(),
            exclusions=exclusions,
        )

    def _two_phase(self, dtype: str) -> bool:
        """Whether the codec sums buckets of ``dtype`` in two phases."""
        codec = self.codec
        return codec is not None and codec.two_phase and codec.applies_to(getattr(torch, dtype))

    def _two_phase_channel(self, execution: ExecutionPlan) -> TwoPhaseChannel | None:
        """The process group (and gloo thread) of the two-phase sums over the whole group, when
        the plan has any (built after pre-flight agreed on the plan, like the groups of
        the algorithms)."""
        if self.options.codec_scope != "all" or execution.world_size == 1:
            return None
        if self.codec is None or not self.codec.two_phase:
            return None
        if not any(n.codec is not None for n in execution.collectives()):
            return None
        return TwoPhaseChannel(self.ranks, self._pg_backend())

    def _pg_backend(self) -> str:
        return str(dist.get_backend(self.group))

    def _bucket_algorithms(
        self, execution: ExecutionPlan, buckets: BucketPlan
    ) -> dict[int, tuple[str, int]]:
        """The algorithm and chunk count the plan gives each bucket."""
        if execution.world_size == 1:
            return {}
        out = {}
        for b in buckets.buckets:
            algorithm = execution.node(plan_dp.bucket_node(b.index)).algorithm
            out[b.index] = (algorithm.name, algorithm.chunks) if algorithm else ("flat", 1)
        return out

    def _algorithm_groups(
        self, execution: ExecutionPlan, buckets: BucketPlan
    ) -> AlgorithmGroups | None:
        """The process groups of the plan's algorithms (built after pre-flight agreed on
        the plan: every rank builds the same groups in the same order)."""
        used = {name for name, _ in self._bucket_algorithms(execution, buckets).values()}
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

    def _bucket_codecs(self, execution: ExecutionPlan, buckets: BucketPlan) -> dict[int, Codec]:
        if self.codec is None or execution.world_size == 1:
            return {}
        return {
            b.index: self.codec
            for b in buckets.buckets
            if execution.node(plan_dp.bucket_node(b.index)).codec is not None
        }

    # -- running -------------------------------------------------------------------------
    def run_forward(
        self, module: nn.Module, forward: Forward, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """One planned forward: a training one (training mode, gradients on) starts a step
        and broadcasts the buffers first; every one runs compiled where ``compile=`` asked."""
        assert self.execution_plan is not None and self.run_log is not None
        if module.training and torch.is_grad_enabled():
            self.run_log.begin_step()
            if self.broadcast_buffers:
                self.broadcast_state(module, "forward")
        with self.run_log.compute("forward"):
            if self.compiled is not None:
                return self.compiled(*args, **kwargs)
            return forward(*args, **kwargs)

    def set_sync(self, enabled: bool) -> None:
        """Whether backward passes average gradients (off inside ``no_sync()``)."""
        self.sync_enabled = enabled
        if self.reducer is not None:
            self.reducer.sync_enabled = enabled

    def broadcast_state(self, module: nn.Module, phase: str) -> None:
        """The plan's broadcasts of ``phase``: parameters and buffers at setup, buffers
        before each training forward."""
        assert self.run_log is not None
        tensors = list(module.buffers())
        if phase == "setup":
            tensors = [*module.parameters(), *tensors]
        run_broadcast_nodes(self.run_log, phase, tensors, self.source, self.group)

    def step_summary(self) -> str:
        """One line: collectives of the last step and every fallback taken."""
        if self.run_log is None:
            return "not planned yet (no forward that records gradients so far)"
        return self.run_log.summary()


@contextmanager
def seen_as(module: nn.Module, cls: type[nn.Module]) -> Iterator[None]:
    """``module`` as an instance of ``cls`` (its class before ``dp`` extended it) for the
    block: the graph capture runs the model's own forward, and ``torch.export`` and
    ``torch.fx`` see its own signature."""
    extended = type(module)
    module.__class__ = cls
    try:
        yield
    finally:
        module.__class__ = extended
