"""What every compiled step shares: :class:`CompiledStep`.

``loss = step(*inputs, target)``. The first call plans the model if it is not planned yet
(a strategy may run this first step eagerly: ZeRO-3 records its units' order there),
declares on the plan that the step is compiled, with its fallbacks, and captures, with
``torch.compile(fullgraph=True)``, one graph per rank of what the strategy's
:meth:`CompiledStep._graph` does: forward, loss, backward, the plan's collectives as
functional collectives, the optimizer's update. The capture goes through
:class:`~.graph_collectives.CheckedBackend`: the graph's collectives are checked against
the plan's and across ranks before it first runs. Later calls replay it.

Declared fallbacks, on the plan's step node (:attr:`CompiledStep.step_node`):

- before the first replay (``when="plan"``, taken with the reason): what the strategy
  finds it cannot put in the graph (an optimizer whose update is not traced, a codec...);
- at the first call (``when="run"``): the capture raising, a graph break under
  ``fullgraph`` above all, with the module and the operation it stopped at
  (``on_graph_break="error"`` raises that as a ``ConfigError`` instead);
- a new input shape compiles again (counted: ``recompiled`` in the run log, the trace and
  ``step_summary()``) up to ``max_shapes`` shapes; a shape past that runs the eager
  step, recorded with the reason each time, while the compiled shapes replay.

The compile time of each new shape is kept (:attr:`CompiledStep.compile_seconds`).
Where the device captures a step (CUDA graphs, :mod:`.device_graph`), each compiled
shape is captured at its second call and replayed as one device graph from then on; the
plan's meta ``device_graphs`` says whether, or why not.
"""

from __future__ import annotations

import dataclasses
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lamina.device.handle import DeviceHandle
from lamina.errors import ConfigError
from lamina.runtime import Compute, ExecutionPlan, Fallback, RunLog
from lamina.strategies.compiled.device_graph import DeviceGraphs
from lamina.strategies.compiled.functional_optim import FunctionalOptimizer, unsupported_reason
from lamina.strategies.compiled.graph_break import graph_break_reason
from lamina.strategies.compiled.graph_collectives import (
    CheckedBackend,
    PlannedCall,
    verification_error,
)
from lamina.strategies.compiled.in_graph import InGraphCollectives

#: The loss of a step from the model's output and the target.
LossFn = Callable[[Any, Any], torch.Tensor]

#: What the plan's step node declares the compiled step falls back to.
EAGER = "eager"

#: What a graph break does: run the eager step (declared) or raise.
GRAPH_BREAK_CHOICES = ("eager", "error")

Signature = tuple[tuple[tuple[int, ...], str], ...]


@dataclass(frozen=True)
class StepOptions:
    """What ``lamina.compile_step`` takes besides the model, optimizer and loss (see
    :func:`lamina.compile_step`); checked as it is built."""

    backend: str | Callable[..., Any] = "inductor"
    max_shapes: int = 2
    on_graph_break: str = "eager"
    eager_random: bool = True
    device_graphs: bool = True
    overlap: bool = False
    #: Clip the gradients to this total norm before the update (None: no clipping), as
    #: ``torch.nn.utils.clip_grad_norm_`` does over the whole model.
    max_norm: float | None = None
    norm_type: float = 2.0

    def __post_init__(self) -> None:
        if self.max_norm is not None and (
            not isinstance(self.max_norm, int | float)
            or isinstance(self.max_norm, bool)
            or not self.max_norm > 0
        ):
            raise ConfigError(
                f"compile_step: max_norm={self.max_norm!r}; pass the total gradient norm to "
                "clip to (a number > 0), or None not to clip"
            )
        if not isinstance(self.norm_type, int | float) or not self.norm_type > 0:
            raise ConfigError(
                f"compile_step: norm_type={self.norm_type!r}; pass the norm's order (2.0, "
                "1.0, float('inf'), ...)"
            )
        if not isinstance(self.max_shapes, int) or self.max_shapes < 1:
            raise ConfigError(
                f"compile_step: max_shapes={self.max_shapes!r}; pass how many input shapes to "
                "compile (>= 1) before new ones run eagerly"
            )
        if self.on_graph_break not in GRAPH_BREAK_CHOICES:
            raise ConfigError(
                f"compile_step: on_graph_break={self.on_graph_break!r}; pass 'eager' (run the "
                "eager step, declared) or 'error'"
            )


class TrainingStep(Protocol):
    """What ``lamina.compile_step`` returns: ``loss = step(*inputs, target)``, one whole
    training step (:class:`CompiledStep`; a pipelined model's
    :class:`~lamina.strategies.pp.compiled.PipelineCompiledStep`)."""

    #: The total gradient norm of the last step, before clipping (None: no clipping).
    last_grad_norm: torch.Tensor | None
    #: Seconds each compiled input shape's first step took.
    compile_seconds: list[float]
    #: Why the step runs eagerly ('' while it runs compiled).
    eager_reason: str

    def __call__(self, *args: Any) -> torch.Tensor:
        """One step on the model's inputs, then the target; the loss."""
        ...


@dataclass(frozen=True)
class StepJob:
    """Where a compiled step runs: the job's control group (the ranks' agreements) and
    the device's handle (None: no lamina runtime)."""

    control_group: dist.ProcessGroup | None = None
    handle: DeviceHandle | None = None


class CompiledStep(ABC):
    """``loss = step(*inputs, target)``: one training step as one captured graph (see
    the module docstring). A strategy's subclass says what the graph holds."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        options: StepOptions,
        job: StepJob,
        inside: Sequence[InGraphCollectives] = (),
    ) -> None:
        backend = options.backend
        #: Composed strategies whose collectives the forward issues (captured with it).
        self.inside = tuple(inside)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.options = options
        self.backend = backend
        #: Input shapes compiled at most (then a new one runs the eager step).
        self.max_shapes = options.max_shapes
        self.on_graph_break = options.on_graph_break
        self.mode = f"compiled_step:{backend if isinstance(backend, str) else 'custom'}"
        #: Why the step runs eagerly ('' while it runs compiled).
        self.eager_reason = ""
        #: Seconds each new input shape took to capture, compile and run once.
        self.compile_seconds: list[float] = []
        self.checked = CheckedBackend(
            backend, self._planned_calls, job.control_group, options.eager_random, options.overlap
        )
        #: Each compiled shape replayed as a device graph, where the device captures one.
        self.graphs = DeviceGraphs(job.handle, options.device_graphs, backend)
        self._functional = FunctionalOptimizer(optimizer)
        self._shapes: list[Signature] = []
        self._failed_at_run = False
        self._declared = False
        self._compiled: Callable[..., Any] | None = None
        #: The total gradient norm of the last step, before clipping (None: no clipping
        #: asked, or no step yet), on every rank.
        self.last_grad_norm: torch.Tensor | None = None

    # -- what a strategy says ----------------------------------------------------------------
    @property
    @abstractmethod
    def plan(self) -> ExecutionPlan | None:
        """The model's execution plan (None before it is planned)."""

    @abstractmethod
    def _set_plan(self, plan: ExecutionPlan) -> None:
        """Replace the model's plan (and its run log's) by ``plan``."""

    @property
    @abstractmethod
    def run_log(self) -> RunLog:
        """The model's run log."""

    @property
    @abstractmethod
    def step_node(self) -> str:
        """The plan node the step's fallbacks are declared on."""

    @abstractmethod
    def _warm_up(self, inputs: list[Any], target: Any) -> torch.Tensor | None:
        """Plan the model if needed; the loss if this call ran the eager step instead."""

    @abstractmethod
    def _plan_time_reason(self, plan: ExecutionPlan) -> str:
        """Why the step cannot be one graph, known before the capture ('' if it can),
        besides an optimizer whose update is not traced (checked here for every one)."""

    #: Whether the strategy's graph clips the gradients itself (dp, zero3, hsdp; else
    #: clipping runs the eager step, a declared plan-time fallback).
    clips_in_graph: bool = False

    @abstractmethod
    def _planned_calls(self) -> Sequence[PlannedCall]:
        """The collective calls the graph issues, in the plan's order."""

    @abstractmethod
    def _arguments(self) -> tuple[Any, ...]:
        """The tensors the graph reads and updates (its inputs besides the batch)."""

    @abstractmethod
    def _graph(
        self, arguments: tuple[Any, ...], lrs: list[torch.Tensor], inputs: list[Any], target: Any
    ) -> torch.Tensor:
        """Forward, loss, backward, the plan's collectives, the update: what is captured;
        the loss (with clipping: the loss and the total norm, stacked)."""

    @abstractmethod
    def _issued(self) -> Sequence[str]:
        """The plan's collective nodes one replay issues (recorded in the run log)."""

    def _declared_plan(self, plan: ExecutionPlan, fallbacks: list[Fallback]) -> ExecutionPlan:
        """``plan`` with its compute nodes in the step's mode and ``fallbacks`` added."""
        mode = EAGER if self.eager_reason else self.mode
        nodes = tuple(
            dataclasses.replace(n, detail=dataclasses.replace(n.detail, mode=mode))
            if isinstance(n.detail, Compute)
            else n
            for n in plan.nodes
        )
        return dataclasses.replace(plan.with_nodes(nodes), fallbacks=(*plan.fallbacks, *fallbacks))

    @contextmanager
    def _replaying(self) -> Iterator[None]:
        """Around each replay (the model seen as its own class, say)."""
        yield

    def _before_replay(self) -> None:  # noqa: B027  (optional, empty by default)
        """Before each replay, outside the graph (buffers broadcast, say)."""

    def _plan_fallback_cases(self) -> str:
        """What the plan-time fallback covers, in words."""
        return "the optimizer's update is not traced, or the plan has what the graph cannot issue"

    # -- the user's call -------------------------------------------------------------------
    def __call__(self, *args: Any) -> torch.Tensor:
        """One step on ``args`` (the model's inputs, then the target); the loss."""
        if len(args) < 2:
            raise TypeError("step(*inputs, target): pass the model's inputs, then the target")
        *inputs, target = args
        warm = self._warm_up(inputs, target)
        if warm is not None:  # an eager step: what it issued inside the forward is kept
            for composed in self.inside:
                composed.keep_order()
            return warm
        if not self._declared:
            self._declare()
        if self.eager_reason:
            return self.eager_step(inputs, target)
        shape = signature_of([*inputs, target])
        new = shape not in self._shapes
        log = self.run_log
        if new and len(self._shapes) >= self.max_shapes:
            loss = self.eager_step(inputs, target)
            log.fallback(self.step_node, EAGER, self._past_bound(shape))
            return loss
        log.begin_step()
        self._before_replay()
        started, entered = time.perf_counter(), self.checked.entered
        compiled_before = len(self.checked.once.outcomes)
        try:
            with log.compute("compile" if new else "compiled step"):
                loss = self._replay(inputs, target, None if new else shape)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if not new:  # a captured graph that ran before failed: not a capture problem
                raise
            self._capture_failed(exc, reached_backend=self.checked.entered > entered)
            return self.eager_step(inputs, target)
        if new:
            self.compile_seconds.append(time.perf_counter() - started)
            self._shapes.append(shape)
            log.compiled(self._first_step_words(compiled_before))
            if len(self._shapes) > 1:
                log.recompiled()
        for node in self._issued():
            log.issued(node)
        log.end_backward()
        for composed in self.inside:
            composed.record_replay()
        # the optimizer stepped: an LR scheduler checks this mark of optimizer.step()
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        if self.options.max_norm is not None:  # the graph returned the loss and the norm
            loss, self.last_grad_norm = loss[0], loss[1]
        return loss

    def _first_step_words(self, compiled_before: int) -> str:
        """The run log's words on a new shape's first step: its seconds, and how its graph
        was compiled (cold or warm, on which ranks: :mod:`.compile_cache`)."""
        how = "; ".join(o.describe() for o in self.checked.once.outcomes[compiled_before:])
        backend = self.backend if isinstance(self.backend, str) else "a custom backend"
        return f"{self.compile_seconds[-1]:.1f} s ({how or f'compiled by {backend} on every rank'})"

    def _capture_failed(self, exc: Exception, reached_backend: bool) -> None:
        """The capture or compilation of a new shape raised (an error of the graph's run
        is raised as it is). A cross-rank mismatch is raised; a graph break, agreed on
        with the other ranks, raises (``on_graph_break="error"``) or is the declared
        eager fallback."""
        mismatch = verification_error(exc)
        if mismatch is not None:
            raise mismatch from exc
        reason = graph_break_reason(self.model, exc)
        if not reached_backend:  # the other ranks compare their graphs with this outcome
            self.checked.capture_failed(reason)
        if self.on_graph_break == "error":
            raise ConfigError(
                f"compile_step could not capture the step: {reason}; make that operation "
                "traceable, or pass on_graph_break='eager' to run the step eagerly"
            ) from exc
        self.eager_reason = reason
        self._failed_at_run = True
        self._now_eager()

    def _now_eager(self) -> None:  # noqa: B027  (optional, empty by default)
        """The step runs eagerly from now on: what the plan said of the graph is undone."""

    # -- planning the graph ------------------------------------------------------------------
    def _declare(self) -> None:
        """The plan's nodes say the step is compiled, with its fallbacks; decide the
        plan-time one."""
        plan = self.plan
        assert plan is not None
        optimizer = unsupported_reason(self.optimizer)
        reason = f"the optimizer: {optimizer}" if optimizer else self._plan_time_reason(plan)
        if not reason and self.options.max_norm is not None and not self.clips_in_graph:
            reason = (
                f"gradient clipping (max_norm={self.options.max_norm}) is not in this "
                "strategy's graph yet: the eager step clips"
            )
        self.eager_reason = reason
        node = self.step_node
        fallbacks = [
            Fallback(
                node,
                self.mode,
                EAGER,
                self._plan_fallback_cases(),
                when="plan",
                taken=bool(reason),
                reason=reason,
            ),
            Fallback(
                node,
                self.mode,
                EAGER,
                "capturing or compiling the step raises (a graph break, say)",
                when="run",
            ),
            Fallback(
                node,
                self.mode,
                EAGER,
                f"an input shape past the {self.max_shapes} compiled ones (max_shapes=)",
                when="run",
            ),
        ]
        declared = self._declared_plan(plan, fallbacks)
        graphs = "replayed" if not self.graphs.reason else f"no: {self.graphs.reason}"
        meta = tuple(sorted((*declared.meta, ("device_graphs", graphs))))
        self._set_plan(dataclasses.replace(declared, meta=meta))
        self._declared = True
        if not reason:
            self._functional.init_state(self._small_tensors_on())

    def _small_tensors_on(self) -> torch.device | None:
        """Where the learning rates and Adam's step counters live: on the parameters'
        accelerator (a device graph, or XLA's one program, reads nothing from the host),
        as they are on the CPU (None)."""
        device = self.graphs.device
        if device is not None:
            return device
        first = next(self.model.parameters(), None)
        if first is None or first.device.type == "cpu":
            return None
        return first.device

    def _past_bound(self, shape: Signature) -> str:
        """Why a step with input ``shape`` runs eagerly."""
        shown = ", ".join(f"{list(dims)}" for dims, _ in shape)
        return (
            f"input shapes {shown} would compile a graph past max_shapes={self.max_shapes}; "
            "the compiled shapes replay, this one runs eagerly"
        )

    # -- running ---------------------------------------------------------------------------
    def _replay(self, inputs: list[Any], target: Any, shape: Signature | None) -> torch.Tensor:
        """The captured step (captured at the first call of each shape); from the second
        call of a ``shape``, replayed as a device graph where there is one."""
        if self._compiled is None:
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, self.max_shapes)
            self._compiled = torch.compile(
                _own_code(self._traced), backend=self.checked, fullgraph=True, dynamic=False
            )
        compiled = self._compiled
        arguments = self._arguments()
        lrs = self._functional.learning_rates(self._small_tensors_on())

        def run(batch: list[Any], rates: list[torch.Tensor]) -> torch.Tensor:
            with self._replaying():
                loss: torch.Tensor = compiled(arguments, rates, batch[:-1], batch[-1])
            return loss

        if shape is None or self.graphs.reason:
            return run([*inputs, target], lrs)
        return self.graphs.run(shape, run, [*inputs, target], lrs)

    def _traced(
        self, arguments: tuple[Any, ...], lrs: list[torch.Tensor], inputs: list[Any], target: Any
    ) -> torch.Tensor:
        return self._graph(arguments, lrs, inputs, target)

    def eager_step(self, inputs: Sequence[Any], target: Any) -> torch.Tensor:
        """The eager step: the model's forward, backward, the optimizer; a run-time
        fallback is recorded in every step it is taken."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(*inputs), target)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.options.max_norm is not None:
            clip = getattr(self.model, "clip_grad_norm_", None)
            norm = (
                clip(self.options.max_norm, self.options.norm_type)
                if callable(clip)
                else torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.options.max_norm, self.options.norm_type
                )
            )
            self.last_grad_norm = norm.detach()
        self.optimizer.step()
        if self._failed_at_run:
            self.run_log.fallback(self.step_node, EAGER, self.eager_reason)
        return loss.detach()


def clipped(
    grads: dict[str, torch.Tensor], max_norm: float, norm_type: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``grads`` (whole, the same on every rank) scaled as
    ``torch.nn.utils.clip_grad_norm_`` scales them, and their total norm (traceable)."""
    values = list(grads.values())
    if norm_type == float("inf"):
        total = torch.stack([g.detach().abs().max() for g in values]).max()
    else:
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type) for g in values])
        total = torch.linalg.vector_norm(norms, norm_type)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {n: g * scale for n, g in grads.items()}, total


def _own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) with a code object of its own: torch.compile keeps its graphs
    and its recompile count per code object, so each compiled step keeps its own (its
    shapes are counted against ``max_shapes`` alone, not with every other step's)."""
    function = method.__func__  # type: ignore[attr-defined]
    return types.MethodType(code_copy(function), method.__self__)  # type: ignore[attr-defined]


def code_copy(function: types.FunctionType) -> types.FunctionType:
    """``function`` with a code object of its own (its defaults and closure kept):
    ``torch.compile``'s graphs and recompile count, kept per code object, are its own."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def signature_of(values: list[Any]) -> Signature:
    """The shapes and dtypes of the step's tensor arguments (what a new graph is for)."""
    return tuple((tuple(v.shape), str(v.dtype)) for v in values if isinstance(v, torch.Tensor))
