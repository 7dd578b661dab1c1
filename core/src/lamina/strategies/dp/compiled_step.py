"""The whole data-parallel step as one captured graph: :class:`CompiledStep`.

``lamina.compile_step(model, optimizer, loss_fn)`` on a model distributed with ``dp``
returns ``step``; ``loss = step(*inputs, target)``. The first call plans the model if it
is not planned yet (lamina.distribute's sequence, from these inputs), then captures, with
``torch.compile(fullgraph=True)``, one graph per rank holding:

- the forward of the model's own class and the loss (``torch.func.functional_call``);
- the backward (``torch.func.grad_and_value`` over the trainable parameters);
- the plan's gradient all-reduces, one per bucket in the plan's order, each over the
  bucket's slots (read from the plan's nodes) as a traceable functional collective
  (``torch.distributed._functional_collectives``), then divided by the group size;
- the optimizer's update, torch's own (:mod:`.functional_optim`), on its own state.

Later calls replay it. Buffers are broadcast before each step, as the eager step does,
outside the graph. The parameters' ``.grad`` stay unset (the gradients live in the
graph) and the optimizer's step hooks do not run; LR schedulers work as with
``optimizer.step()``. What cannot be captured runs the eager step (forward, backward with
the reducer, ``optimizer.step()``), declared on the plan's ``forward`` node:

- decided before the first call (``when="plan"``, taken, with the reason): an optimizer
  whose update is not traced, parameters the captured forward did not use (the eager
  step leaves their gradient ``None``), a codec or an algorithm other than ``flat`` on a
  bucket (the graph issues plain all-reduces);
- at the first call (``when="run"``, in the run log and ``step_summary()``): capture or
  compilation raising (a graph break under ``fullgraph``, say), with the reason;
- a new input shape compiles again (counted: ``recompiled`` in the run log and
  ``step_summary()``) up to ``max_shapes`` shapes (default 2); a shape past that runs
  the eager step, recorded with the reason each time, while the compiled ones replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.func import functional_call, grad_and_value

from lamina.comm.buckets import Bucket, BucketPlan
from lamina.errors import ConfigError, failure_reason
from lamina.runtime import Compute, ExecutionPlan, Fallback
from lamina.strategies.contract import StepInputs
from lamina.strategies.dp import plan as plan_dp
from lamina.strategies.dp.functional_optim import FunctionalOptimizer, unsupported_reason
from lamina.strategies.dp.planner import DataParallelState, seen_as

#: The loss of a step from the model's output and the target.
LossFn = Callable[[Any, Any], torch.Tensor]

#: What the plan's forward node declares the compiled step falls back to.
EAGER = "eager"


class CompiledStep:
    """``loss = step(*inputs, target)``: one training step of a ``dp`` model (see the
    module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        state: DataParallelState,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        backend: str | Callable[..., Any] = "inductor",
        max_shapes: int = 2,
    ) -> None:
        if not isinstance(max_shapes, int) or max_shapes < 1:
            raise ConfigError(
                f"compile_step: max_shapes={max_shapes!r}; pass how many input shapes to "
                "compile (>= 1) before new ones run eagerly"
            )
        self.model = model
        #: Input shapes compiled at most (then a new one runs the eager step).
        self.max_shapes = max_shapes
        self._shapes: list[tuple[tuple[tuple[int, ...], str], ...]] = []
        self.state = state
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.backend = backend
        self.mode = f"compiled_step:{backend if isinstance(backend, str) else 'custom'}"
        #: Why the step runs eagerly ('' while it runs compiled).
        self.eager_reason = ""
        self._failed_at_run = False
        self._functional = FunctionalOptimizer(optimizer)
        self._compiled: Callable[..., Any] | None = None
        self._buckets: BucketPlan | None = None

    # -- the user's call -------------------------------------------------------------------
    def __call__(self, *args: Any) -> torch.Tensor:
        """One step on ``args`` (the model's inputs, then the target); the loss."""
        if len(args) < 2:
            raise TypeError("step(*inputs, target): pass the model's inputs, then the target")
        *inputs, target = args
        state = self.state
        if state.execution_plan is None:  # lamina.distribute's sequence, from these inputs
            state.plan_and_build(StepInputs(tuple(inputs), {}))
        if self._buckets is None:
            self._declare()
        log = state.run_log
        assert log is not None
        if self.eager_reason:
            return self._eager(inputs, target)
        shape = _signature([*inputs, target])
        new = shape not in self._shapes
        if new and len(self._shapes) >= self.max_shapes:
            loss = self._eager(inputs, target)
            log.fallback(plan_dp.FORWARD, EAGER, self._past_bound(shape))
            return loss
        log.begin_step()
        if state.broadcast_buffers:
            state.broadcast_state(self.model, "forward")
        try:
            loss = self._replay(inputs, target)
        except Exception as exc:
            if not new:  # a captured graph that ran before failed: not a capture problem
                raise
            self.eager_reason = failure_reason(exc)
            self._failed_at_run = True
            return self._eager(inputs, target)
        if new:
            self._shapes.append(shape)
            if len(self._shapes) > 1:
                log.recompiled()
        assert self._buckets is not None
        for bucket in self._buckets.buckets:
            log.issued(plan_dp.bucket_node(bucket.index))
        log.end_backward()
        # the optimizer stepped: an LR scheduler checks this mark of optimizer.step()
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return loss

    # -- planning the graph ------------------------------------------------------------------
    def _declare(self) -> None:
        """The plan's nodes say the step is compiled, with its fallbacks; decide the
        plan-time one."""
        state = self.state
        plan = state.execution_plan
        assert plan is not None and state.plan is not None
        self._buckets = plan_dp.bucket_plan_of(plan, state.plan)
        reason = self._plan_time_reason(plan)
        fallbacks = [
            Fallback(
                plan_dp.FORWARD,
                self.mode,
                EAGER,
                "the optimizer's update is not traced, a parameter is unused, or a bucket "
                "has a codec or an algorithm",
                when="plan",
                taken=bool(reason),
                reason=reason,
            ),
            Fallback(
                plan_dp.FORWARD,
                self.mode,
                EAGER,
                "capturing or compiling the step raises (a graph break, say)",
                when="run",
            ),
            Fallback(
                plan_dp.FORWARD,
                self.mode,
                EAGER,
                f"an input shape past the {self.max_shapes} compiled ones (max_shapes=)",
                when="run",
            ),
        ]
        mode = EAGER if reason else self.mode
        nodes = tuple(
            dataclasses.replace(n, detail=dataclasses.replace(n.detail, mode=mode))
            if isinstance(n.detail, Compute)
            else n
            for n in plan.nodes
        )
        declared = dataclasses.replace(
            plan.with_nodes(nodes), fallbacks=(*plan.fallbacks, *fallbacks)
        )
        state.execution_plan = declared
        assert state.run_log is not None
        state.run_log.plan = declared
        self.eager_reason = reason
        if not reason:
            self._functional.init_state()

    def _plan_time_reason(self, plan: ExecutionPlan) -> str:
        """Why the step cannot be one graph, known before the first call ('' if it can)."""
        reason = unsupported_reason(self.optimizer)
        if reason:
            return f"the optimizer: {reason}"
        assert self._buckets is not None
        if self._buckets.excluded:
            return (
                f"{len(self._buckets.excluded)} parameter(s) unused in the captured forward "
                "(their gradient stays None in the eager step)"
            )
        for node in plan.collectives():
            if node.codec is not None:
                return f"bucket node {node.id} has codec {node.codec.name}"
            if node.algorithm is not None and node.algorithm.name != "flat":
                return f"bucket node {node.id} runs {node.algorithm.describe()}"
        return ""

    def _past_bound(self, shape: tuple[tuple[tuple[int, ...], str], ...]) -> str:
        """Why a step with input ``shape`` runs eagerly."""
        shown = ", ".join(f"{list(dims)}" for dims, _ in shape)
        return (
            f"input shapes {shown} would compile a graph past max_shapes={self.max_shapes}; "
            "the compiled shapes replay, this one runs eagerly"
        )

    # -- running ---------------------------------------------------------------------------
    def _replay(self, inputs: list[Any], target: Any) -> torch.Tensor:
        """The captured step (captured at the first call)."""
        if self._compiled is None:
            self._compiled = torch.compile(self._step, backend=self.backend, fullgraph=True)
        params, buffers, grouped = self._arguments()
        lrs = self._functional.learning_rates()
        with seen_as(self.model, self.state.model_class):  # the traced forward: the model's
            loss: torch.Tensor = self._compiled(params, buffers, grouped, lrs, inputs, target)
        return loss

    def _arguments(
        self,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[list[str]]]:
        """The trainable parameters and the buffers by name, and each optimizer group's
        parameter names."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        params: dict[str, torch.Tensor] = {
            n: p for n, p in self.model.named_parameters() if p.requires_grad
        }
        buffers = dict(self.model.named_buffers())
        grouped = [[names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        return params, buffers, grouped

    def _step(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        grouped: list[list[str]],
        lrs: list[torch.Tensor],
        inputs: list[Any],
        target: Any,
    ) -> torch.Tensor:
        """Forward, loss, backward, the plan's all-reduces, the update: what is captured."""
        model, loss_fn = self.model, self.loss_fn

        def loss_of(trained: dict[str, torch.Tensor]) -> torch.Tensor:
            out = functional_call(model, {**trained, **buffers}, tuple(inputs))
            loss: torch.Tensor = loss_fn(out, target)
            return loss

        grads, loss = grad_and_value(loss_of)(params)
        averaged = self._all_reduced(grads)
        self._functional.update([[averaged[n] for n in names] for names in grouped], lrs)
        detached: torch.Tensor = loss.detach()
        return detached

    def _all_reduced(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each bucket of the plan flattened in slot order (padded), summed over the
        group, divided by its size, cut back into the parameters' gradients."""
        assert self._buckets is not None
        group, size = self.state.group, len(self.state.ranks)
        world = dist.group.WORLD
        assert world is not None
        out = dict(grads)
        if size == 1:
            return out
        for bucket in self._buckets.buckets:
            flat = torch.cat(_packed(grads, bucket))
            summed = funcol.all_reduce(flat, "sum", group if group is not None else world)
            mean = summed / size
            for slot in bucket.slots:
                out[slot.name] = mean[slot.offset : slot.offset + slot.numel].view(slot.shape)
        return out

    def _eager(self, inputs: list[Any], target: Any) -> torch.Tensor:
        """The eager step: the planned forward, backward with the reducer, the optimizer;
        a run-time fallback is recorded in every step it is taken."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(*inputs), target)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        if self._failed_at_run and self.state.run_log is not None:
            self.state.run_log.fallback(plan_dp.FORWARD, EAGER, self.eager_reason)
        return loss.detach()


def _packed(grads: dict[str, torch.Tensor], bucket: Bucket) -> list[torch.Tensor]:
    """The bucket's gradients flattened in slot order, with zeros where the layout pads
    (between slots and at the end): one ``torch.cat`` makes the bucket's buffer."""
    pieces: list[torch.Tensor] = []
    cursor = 0
    for slot in bucket.slots:
        grad = grads[slot.name]
        if slot.offset > cursor:
            pieces.append(grad.new_zeros(slot.offset - cursor))
        pieces.append(grad.reshape(-1))
        cursor = slot.offset + slot.numel
    if bucket.numel > cursor:
        pieces.append(pieces[-1].new_zeros(bucket.numel - cursor))
    return pieces


def _signature(values: list[Any]) -> tuple[tuple[tuple[int, ...], str], ...]:
    """The shapes and dtypes of the step's tensor arguments (what a new graph is for)."""
    return tuple((tuple(v.shape), str(v.dtype)) for v in values if isinstance(v, torch.Tensor))
