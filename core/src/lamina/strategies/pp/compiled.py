"""The compiled step of a pipelined model (:class:`PipelineCompiledStep`).

``loss = step(*inputs, target)`` runs what the eager pipelined step runs (torch's
schedule over the microbatches, the gradient sums, clipping, the optimizer), with every
block of this rank's stages compiled, forward and backward, by ``torch.compile``. The
schedule's sends and recvs stay outside the graphs, in torch's schedule: torch's
functional collectives (what a graph can hold) have no send or recv, and each transfer
sits between two chunks that the schedule orders at run time.

Each block is captured at its first call in a new input shape's first step, with
``fullgraph=True``; a block whose capture fails (a graph break: its module and operation
named; a collective in it, tp's say) runs eagerly for the rest of that step (a failed
capture has run nothing). After the step the ranks agree: every block compiled on every
rank, or every rank runs the eager step from then on, with the reason, the plan's
declared fallback. A shape past ``max_shapes`` runs eagerly, recorded with the reason.
Blocks of one class share their graphs (guarded on what differs between their calls).
"""

from __future__ import annotations

import dataclasses
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lamina.errors import ConfigError
from lamina.runtime import Compute, ExecutionPlan, Fallback, RunLog
from lamina.strategies.compiled.graph_break import graph_break_reason
from lamina.strategies.compiled.graph_collectives import graph_collectives
from lamina.strategies.compiled.step import (
    EAGER,
    LossFn,
    Signature,
    StepJob,
    StepOptions,
    code_copy,
    signature_of,
)
from lamina.strategies.pp.plan_nodes import OPTIMIZER
from lamina.strategies.pp.stages import GatedBlock


class StageBlockBackend:
    """``torch.compile``'s backend for a stage's block: a graph holding a collective is
    refused (its transfers and collectives stay in the eager schedule); the rest compile
    with ``inner`` (Inductor drawing random numbers as eager does, with ``eager_random``)."""

    def __init__(self, inner: str | Callable[..., Any], eager_random: bool) -> None:
        self.inner = inner
        self.eager_random = eager_random
        #: Graphs compiled (blocks of one class share one).
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        found = graph_collectives(gm)
        if found:
            raise RuntimeError(
                f"a pipeline stage's block issues {found[0].op} inside its forward; its "
                "collectives are not compiled within a stage"
            )
        self.graphs += 1
        inner = self.inner
        compile_with = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner
        patch: Any = nullcontext()
        if inner == "inductor":
            from torch._inductor import config as inductor_config

            patch = inductor_config.patch({"fallback_random": self.eager_random})
        with patch:
            return compile_with(gm, example_inputs)


class PipelineCompiledStep:
    """``loss = step(*inputs, target)``: a pipelined model's training step with its
    stages' blocks compiled (see the module); ``last_grad_norm`` after each step when
    clipping, ``compile_seconds`` per compiled shape, ``eager_reason`` when it runs
    eagerly."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        options: StepOptions,
        job: StepJob,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.options = options
        self.job = job
        backend = options.backend
        self.mode = f"compiled_blocks:{backend if isinstance(backend, str) else 'custom'}"
        self.backend = StageBlockBackend(backend, options.eager_random)
        self.engine = model.__dict__["lamina_pp"].engine
        self.gates: tuple[GatedBlock, ...] = tuple(
            g for runner in self.engine.runners for g in runner.gates
        )
        own = _own_codes(self.gates)
        self._compiled = {
            id(gate): torch.compile(
                own[id(gate)], backend=self.backend, fullgraph=True, dynamic=False
            )
            for gate in self.gates
        }
        #: Why the step runs eagerly ('' while its blocks compile).
        self.eager_reason = ""
        #: Seconds each compiled shape's first step took (the captures and compiles in it).
        self.compile_seconds: list[float] = []
        #: The total gradient norm of the last step, before clipping (None: no clipping).
        self.last_grad_norm: torch.Tensor | None = None
        self._shapes: list[Signature] = []
        self._declared = False

    # -- the plan --------------------------------------------------------------------------
    @property
    def _state(self) -> Any:
        return self.model.__dict__["lamina_pp"]

    @property
    def plan(self) -> ExecutionPlan:
        """The pipeline's plan."""
        plan: ExecutionPlan = self._state.execution_plan
        return plan

    @property
    def run_log(self) -> RunLog:
        """The pipeline's run log."""
        log: RunLog = self._state.run_log
        return log

    def _declare(self) -> None:
        """The stages' compute nodes say their blocks are compiled; the fallbacks."""
        reason = ""
        if not self.gates:
            reason = "this rank's stages hold no block to compile"
        self._set_mode(EAGER if reason else self.mode)
        fallbacks = (
            Fallback(
                OPTIMIZER,
                self.mode,
                EAGER,
                "compiling a stage's block raises (a graph break, a collective in it) on any rank",
                when="run",
            ),
            Fallback(
                OPTIMIZER,
                self.mode,
                EAGER,
                f"an input shape past the {self.options.max_shapes} compiled ones (max_shapes=)",
                when="run",
            ),
        )
        plan = self.plan
        self._set_plan(dataclasses.replace(plan, fallbacks=(*plan.fallbacks, *fallbacks)))
        self.eager_reason = reason
        self._declared = True

    def _set_mode(self, mode: str) -> None:
        plan = self.plan
        nodes = tuple(
            dataclasses.replace(n, detail=dataclasses.replace(n.detail, mode=mode))
            if isinstance(n.detail, Compute) and n.detail.stage is not None
            else n
            for n in plan.nodes
        )
        self._set_plan(plan.with_nodes(nodes))

    def _set_plan(self, plan: ExecutionPlan) -> None:
        self._state.execution_plan = plan
        self.run_log.plan = plan

    # -- the user's call -------------------------------------------------------------------
    def __call__(self, *args: Any) -> torch.Tensor:
        """One step on ``args`` (the model's inputs, then the target); the loss."""
        if len(args) < 2:
            raise TypeError("step(*inputs, target): pass the model's inputs, then the target")
        *inputs, target = args
        if not self._declared:
            self._declare()
        if self.eager_reason:
            return self._step(inputs, target, self._eager_runs())
        shape = signature_of([*inputs, target])
        if shape in self._shapes:
            return self._step(inputs, target, self._compiled_runs())
        if len(self._shapes) >= self.options.max_shapes:
            loss = self._step(inputs, target, self._eager_runs())
            self.run_log.fallback(OPTIMIZER, EAGER, self._past_bound(shape))
            return loss
        return self._first_step(inputs, target, shape)

    def _first_step(self, inputs: list[Any], target: Any, shape: Signature) -> torch.Tensor:
        """A new shape: each block captured at its first call (eager where that fails);
        the ranks agree on the outcome."""
        started = time.perf_counter()
        trials: dict[int, Callable[..., Any]] = {
            id(g): _Trial(g.run, self._compiled[id(g)], self.model) for g in self.gates
        }
        loss = self._step(inputs, target, trials)
        failures = [t.failure for t in trials.values() if isinstance(t, _Trial) and t.failure]
        agreed = _failed_anywhere(bool(failures), self.job.control_group)
        if agreed:
            mine = failures[0] if failures else "another rank could not compile its stages"
            self.eager_reason = mine
            self._set_mode(EAGER)
            if self.options.on_graph_break == "error":
                raise ConfigError(
                    f"compile_step could not compile a pipeline stage's block: {mine}; make "
                    "that operation traceable, or pass on_graph_break='eager' to run the "
                    "step eagerly"
                )
            self.run_log.fallback(OPTIMIZER, EAGER, mine)
            return loss
        self.compile_seconds.append(time.perf_counter() - started)
        self._shapes.append(shape)
        backend = self.options.backend
        named = backend if isinstance(backend, str) else "a custom backend"
        self.run_log.compiled(
            f"{self.compile_seconds[-1]:.1f} s ({len(self.gates)} block(s) compiled "
            f"by {named} into {self.backend.graphs} graph(s) on this rank)"
        )
        if len(self._shapes) > 1:
            self.run_log.recompiled()
        return loss

    def _eager_runs(self) -> dict[int, Callable[..., Any]]:
        return {id(g): g.run for g in self.gates}

    def _compiled_runs(self) -> dict[int, Callable[..., Any]]:
        return dict(self._compiled)

    def _step(
        self, inputs: list[Any], target: Any, runs: dict[int, Callable[..., Any]]
    ) -> torch.Tensor:
        """The pipelined step with each block running ``runs[id(gate)]``: the schedule,
        the gradient sums, clipping, the optimizer."""
        self.optimizer.zero_grad(set_to_none=True)
        with _blocks_running(self.gates, runs), _no_donated_buffers():
            loss = self.engine.step(tuple(inputs), target, self.loss_fn)
        if self.options.max_norm is not None:
            clip: Callable[[float, float], torch.Tensor] = self.model.clip_grad_norm_  # type: ignore[assignment]
            norm = clip(self.options.max_norm, self.options.norm_type)
            self.last_grad_norm = norm.detach()
        self.optimizer.step()
        held: torch.Tensor = loss
        return held

    def _past_bound(self, shape: Signature) -> str:
        shown = ", ".join(f"{list(dims)}" for dims, _ in shape)
        return (
            f"input shapes {shown} would compile the blocks past max_shapes="
            f"{self.options.max_shapes}; the compiled shapes run compiled, this one eagerly"
        )

    def step_summary(self) -> str:
        """The model's summary and the run log's line (first steps, fallbacks)."""
        summary: str = self.model.step_summary()  # type: ignore[operator]
        return f"{summary}\n{self.run_log.summary()}"


class _Trial:
    """A block's forward in a new shape's first step: its first call captured and
    compiled; a failure kept in :attr:`failure`, and the block run eagerly from then on
    in this step (a failed capture changes nothing: its side effects are never run)."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any], model: nn.Module):
        self.eager = eager
        self.compiled = compiled
        self.model = model
        self.failure = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failure:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            self.failure = graph_break_reason(self.model, exc)
        return self.eager(*args, **kwargs)


def _own_codes(gates: tuple[GatedBlock, ...]) -> dict[int, Callable[..., Any]]:
    """Each gate's forward with a code object this step alone uses, one per function
    (``torch.compile`` keeps graphs per code object: blocks of one class share theirs,
    and no other step's graphs or recompile count mix with them)."""
    copies: dict[int, types.FunctionType] = {}
    out: dict[int, Callable[..., Any]] = {}
    for gate in gates:
        run = gate.run
        function = getattr(run, "__func__", None)
        if not isinstance(function, types.FunctionType):
            out[id(gate)] = run
            continue
        copy = copies.get(id(function))
        if copy is None:
            copy = copies[id(function)] = code_copy(function)
        out[id(gate)] = types.MethodType(copy, run.__self__)  # type: ignore[attr-defined]
    return out


def _no_donated_buffers() -> Any:
    """AOT autograd compiling (the backward: at its first call) with no buffer donated:
    torch's stages run a backward in parts (its input half keeps the graph for its
    weight half), which a donated buffer forbids."""
    return torch._functorch.config.patch(donated_buffer=False)


@contextmanager
def _blocks_running(
    gates: tuple[GatedBlock, ...], runs: dict[int, Callable[..., Any]]
) -> Iterator[None]:
    """Each gate running ``runs[id(gate)]`` for the block; its own forward back after."""
    own = [g.run for g in gates]
    for gate in gates:
        gate.run = runs[id(gate)]
    try:
        yield
    finally:
        for gate, run in zip(gates, own, strict=True):
            gate.run = run


def _failed_anywhere(failed: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether any rank of the job failed (every rank learns it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    return int(flag) > 0
