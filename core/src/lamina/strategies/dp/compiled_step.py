"""The whole data-parallel step as one captured graph: :class:`DataParallelCompiledStep`.

``lamina.compile_step(model, optimizer, loss_fn)`` on a model distributed with ``dp``
(the shared machinery: :mod:`lamina.strategies.compiled.step`). The first call plans the
model if it is not planned yet (lamina.distribute's sequence, from these inputs), then
captures one graph per rank holding:

- the forward of the model's own class and the loss (``torch.func.functional_call``);
- the backward (``torch.func.grad_and_value`` over the trainable parameters);
- the plan's gradient all-reduces, one per bucket in the plan's order, each over the
  bucket's slots (read from the plan's nodes) as a traceable functional collective
  (``torch.distributed._functional_collectives``), then divided by the group size; a
  bucket with a two-phase codec (fp8, int8) is divided first and summed through the
  codec's two phases (:mod:`lamina.strategies.compiled.graph_codecs`), its
  error-feedback residuals the eager reducer's own, updated in place;
- with ``max_norm``, the averaged gradients clipped to that total norm as
  ``torch.nn.utils.clip_grad_norm_`` clips them (they are whole on every rank: no
  collective), the norm returned beside the loss (``step.last_grad_norm``);
- the optimizer's update, torch's own (:mod:`lamina.strategies.compiled.functional_optim`).

Buffers are broadcast before each step, as the eager step does, outside the graph. The
parameters' ``.grad`` stay unset (the gradients live in the graph) and the optimizer's
step hooks do not run; LR schedulers work as with ``optimizer.step()``. Decided before
the first capture (a plan fallback on the ``forward`` node, with the reason): an
optimizer whose update is not traced, parameters the captured forward did not use (the
eager step leaves their gradient ``None``), a codec the graph cannot sum (a cast codec, a
plugin's without :meth:`~lamina.comm.codecs.TwoPhaseCodec.traced`, ``codec_scope="inter"``),
or the ``ordered`` algorithm on a bucket. A bucket the plan gives the hierarchical (or
pipelined) algorithm keeps it in the graph: reduce-scatter inside each host, all-reduce
across the hosts, gather inside (:mod:`lamina.strategies.compiled.graph_algorithms`). A
step in which a rank flags a codec bucket reduces it exactly in the graph, as the eager
reducer does, and the run log records that fallback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.func import functional_call, grad_and_value

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.buckets import Bucket, BucketPlan
from lamina.comm.codecs import TwoPhaseCodec
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.compiled.functional_optim import trained
from lamina.strategies.compiled.graph_algorithms import (
    hierarchical_all_reduce,
    hierarchical_calls,
)
from lamina.strategies.compiled.graph_codecs import (
    FLAGGED_HERE,
    NOT_USED,
    GraphCodec,
    two_phase_calls,
    two_phase_mean,
    untraced_reason,
)
from lamina.strategies.compiled.graph_collectives import PlannedCall
from lamina.strategies.compiled.step import (
    CompiledStep,
    LossFn,
    StepJob,
    StepOptions,
    clipped,
)
from lamina.strategies.contract import StepInputs
from lamina.strategies.dp import plan as plan_dp
from lamina.strategies.dp.planner import DataParallelState, seen_as

#: The bucket algorithms the graph issues as they are planned (``ordered`` renumbers a
#: gloo ring outside torch's named groups, which functional collectives need).
IN_GRAPH = ("flat", "hierarchical", "pipelined")


class DataParallelCompiledStep(CompiledStep):
    """``loss = step(*inputs, target)``: one training step of a ``dp`` model (see the
    module docstring)."""

    clips_in_graph = True

    def __init__(
        self,
        model: nn.Module,
        state: DataParallelState,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        options: StepOptions,
        job: StepJob,
    ) -> None:
        super().__init__(model, optimizer, loss_fn, options, job)
        self.state = state
        self._buckets: BucketPlan | None = None
        #: The buckets summed with their codec in the graph, by bucket index.
        self._codecs: dict[int, GraphCodec] = {}
        #: Per codec bucket (in plan order) after each replay: not used, flagged here.
        self._codec_flags: torch.Tensor | None = None

    @property
    def plan(self) -> ExecutionPlan | None:
        """The model's execution plan (None before it is planned)."""
        return self.state.execution_plan

    def _set_plan(self, plan: ExecutionPlan) -> None:
        self.state.execution_plan = plan
        self.run_log.plan = plan

    @property
    def run_log(self) -> RunLog:
        """The model's run log."""
        log = self.state.run_log
        assert log is not None
        return log

    @property
    def step_node(self) -> str:
        """The plan's ``forward`` node."""
        return plan_dp.FORWARD

    def _warm_up(self, inputs: list[Any], target: Any) -> torch.Tensor | None:
        """Plan from these inputs if the model is not planned yet (no eager step)."""
        state = self.state
        if state.execution_plan is None:  # lamina.distribute's sequence, from these inputs
            state.plan_and_build(StepInputs(tuple(inputs), {}))
        if self._buckets is None:
            plan = state.execution_plan
            assert plan is not None and state.plan is not None
            self._buckets = plan_dp.bucket_plan_of(plan, state.plan)
        return None

    def _plan_fallback_cases(self) -> str:
        return (
            "the optimizer's update is not traced, a parameter is unused, or a bucket "
            "has a codec the graph cannot sum or the ordered algorithm"
        )

    def _plan_time_reason(self, plan: ExecutionPlan) -> str:
        """Why the step cannot be one graph, known before the first call ('' if it can)."""
        assert self._buckets is not None
        if self._buckets.excluded:
            return (
                f"{len(self._buckets.excluded)} parameter(s) unused in the captured forward "
                "(their gradient stays None in the eager step)"
            )
        for node in plan.collectives():
            if node.codec is not None:
                reason = untraced_reason(node.id, node.codec, self.state.codec)
                if reason:
                    return reason
                continue  # the codec's two-phase sum is the bucket's algorithm
            if node.algorithm is not None and node.algorithm.name not in IN_GRAPH:
                return f"bucket node {node.id} runs {node.algorithm.describe()}"
        self._codecs = self._graph_codecs(plan)
        return ""

    def _graph_codecs(self, plan: ExecutionPlan) -> dict[int, GraphCodec]:
        """The buckets the graph sums with their codec, each with the eager reducer's sum
        of it (whose residuals the graph shares)."""
        assert self._buckets is not None
        reducer = self.state.reducer
        if reducer is None or len(self.state.ranks) == 1:
            return {}
        sums = {state.plan.index: state.sums for state in reducer._buckets}
        group = self.state.group
        rank, native = dist.get_rank(group), self._native()
        out: dict[int, GraphCodec] = {}
        for bucket in self._buckets.buckets:
            node = plan_dp.bucket_node(bucket.index)
            codec = self.state.codec
            if plan.node(node).codec is None or not isinstance(codec, TwoPhaseCodec):
                continue
            traced = codec.traced()
            assert traced is not None and len(sums[bucket.index]) == 1
            eager = sums[bucket.index][0]
            size = len(self.state.ranks)
            out[bucket.index] = GraphCodec(
                node, codec, traced, eager, bucket.numel, size, rank, native
            )
        return out

    def _algorithm(self, bucket: Bucket) -> tuple[str, int]:
        """The plan's algorithm of ``bucket`` and its chunks (``flat``, 1 without one)."""
        plan = self.plan
        assert plan is not None
        fact = plan.node(plan_dp.bucket_node(bucket.index)).algorithm
        if fact is None:
            return "flat", 1
        return fact.name, fact.chunks

    def _hosts(self) -> tuple[AlgorithmGroups, int, bool]:
        """The hierarchical algorithms' groups, ranks per host, and whether the backend's
        own reduce-scatter and gather serve (else gloo's forms)."""
        groups = self.state.algorithm_groups
        assert groups is not None
        return groups, groups.layout.per_host, groups.pg_backend != "gloo"

    def _planned_calls(self) -> list[PlannedCall]:
        if len(self.state.ranks) == 1 or self._buckets is None:
            return []
        calls: list[PlannedCall] = []
        for bucket in self._buckets.buckets:
            node = plan_dp.bucket_node(bucket.index)
            coded = self._codecs.get(bucket.index)
            if coded is not None:
                block = coded.traced.block
                calls += two_phase_calls(node, bucket.numel, coded.world, block, coded.native)
                continue
            name, chunks = self._algorithm(bucket)
            if name == "flat":
                calls.append(PlannedCall(node, "all_reduce", bucket.numel))
                continue
            _, local, native = self._hosts()
            calls += hierarchical_calls(node, bucket.numel, local, native, chunks)
        return calls

    def _native(self) -> bool:
        """Whether the group's backend gathers natively (else one broadcast per rank)."""
        return str(dist.get_backend(self.state.group)) != "gloo"

    def _issued(self) -> list[str]:
        """The bucket nodes this replay issued; a codec bucket a rank flagged (reduced
        exactly in the graph, as the eager reducer does) is recorded as a fallback."""
        issued = list(dict.fromkeys(c.node for c in self._planned_calls()))
        flags = self._codec_flags
        if flags is None or not self._codecs:
            return issued
        for coded, row in zip(self._codecs.values(), flags.tolist(), strict=True):
            if not row[NOT_USED]:
                continue
            why = "this rank flagged it" if row[FLAGGED_HERE] else "another rank flagged it"
            reason = (
                f"{coded.codec.name} sum not used: {why} (an input not finite, past "
                "overflow_at or quantized past error_bound)"
            )
            self.run_log.fallback(coded.node, coded.codec.fallback, reason)
            if self.state.reducer is not None:
                self.state.reducer.stats.codec_fallbacks += 1
            issued.append(coded.node)  # the exact all-reduce
        return issued

    def _before_replay(self) -> None:
        if self.state.broadcast_buffers:
            self.state.broadcast_state(self.model, "forward")

    @contextmanager
    def _replaying(self) -> Iterator[None]:
        with seen_as(self.model, self.state.model_class):  # the traced forward: the model's
            yield

    def _arguments(self) -> tuple[Any, ...]:
        """The trainable parameters and the buffers by name, and each optimizer group's
        parameter names."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        params: dict[str, torch.Tensor] = {
            n: p for n, p in self.model.named_parameters() if p.requires_grad
        }
        buffers = dict(self.model.named_buffers())
        grouped = [[names[id(p)] for p in trained(g)] for g in self.optimizer.param_groups]
        return params, buffers, grouped, self._functional.tensors(), self._codec_state()

    def _codec_state(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor] | None], Any]:
        """Each codec bucket's residuals (the eager sums', None without error feedback)
        and the flags tensor the graph writes (None without codec buckets)."""
        if not self._codecs:
            return [], None
        device = next(self.model.parameters()).device
        if self._codec_flags is None:
            self._codec_flags = torch.zeros(len(self._codecs), 2, dtype=torch.bool, device=device)
        return [c.residuals(device) for c in self._codecs.values()], self._codec_flags

    def _graph(
        self, arguments: tuple[Any, ...], lrs: list[torch.Tensor], inputs: list[Any], target: Any
    ) -> torch.Tensor:
        """Forward, loss, backward, the plan's all-reduces, the update: what is captured."""
        params, buffers, grouped, updated, codec_state = arguments
        model, loss_fn = self.model, self.loss_fn

        def loss_of(trained: dict[str, torch.Tensor]) -> torch.Tensor:
            out = functional_call(model, {**trained, **buffers}, tuple(inputs))
            loss: torch.Tensor = loss_fn(out, target)
            return loss

        grads, loss = grad_and_value(loss_of)(params)
        averaged = self._all_reduced(grads, codec_state)
        max_norm = self.options.max_norm
        norm = None
        if max_norm is not None:  # the averaged gradients are whole on every rank
            averaged, norm = clipped(averaged, max_norm, self.options.norm_type)
        self._functional.update(updated, [[averaged[n] for n in names] for names in grouped], lrs)
        detached: torch.Tensor = loss.detach()
        if norm is not None:
            return torch.stack([detached, norm.to(detached.dtype)])
        return detached

    def _all_reduced(
        self, grads: dict[str, torch.Tensor], codec_state: tuple[list[Any], Any]
    ) -> dict[str, torch.Tensor]:
        """Each bucket of the plan flattened in slot order (padded), summed over the
        group, divided by its size, cut back into the parameters' gradients (a codec
        bucket divided first, then summed through the codec's two phases)."""
        assert self._buckets is not None
        group, size = self.state.group, len(self.state.ranks)
        world = dist.group.WORLD
        assert world is not None
        out = dict(grads)
        if size == 1:
            return out
        residuals, flags = codec_state
        coded_flags: list[torch.Tensor] = []
        for bucket in self._buckets.buckets:
            flat = torch.cat(_packed(grads, bucket))
            coded = self._codecs.get(bucket.index)
            if coded is not None:
                mean, flagged = two_phase_mean(
                    coded,
                    flat.detach() / size,  # as the eager reducer averages before the codec
                    residuals[len(coded_flags)],
                    group if group is not None else world,
                )
                coded_flags.append(flagged)
                for slot in bucket.slots:
                    view = mean[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    out[slot.name] = view
                continue
            name, chunks = self._algorithm(bucket)
            if name == "flat":
                summed = funcol.all_reduce(flat, "sum", group if group is not None else world)
            else:
                hosts, local, native = self._hosts()
                summed = hierarchical_all_reduce(
                    flat, hosts.intra, hosts.inter, local, native, chunks
                )
            mean = summed / size
            for slot in bucket.slots:
                out[slot.name] = mean[slot.offset : slot.offset + slot.numel].view(slot.shape)
        if flags is not None:
            flags.copy_(torch.stack(coded_flags))
        return out


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
