"""What runs a pipelined step (:class:`PipelineEngine`): torch's schedule over this
rank's stages, then the gradient all-reduces the plan lists (the replicas' average, then
each tied weight's sum over its stages, split among the replicas), then the loss handed
to every rank of the pipeline. Where ZeRO-3 or HSDP shards the stages over the other
axes (composed after ``pp``), a :class:`StepSharding` gathers them for the whole step
and reduce-scatters the summed gradients after it, in place of the replicas' average."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lamina.errors import ConfigError
from lamina.runtime.log import RunLog
from lamina.strategies.pp.layout import PipelineLayout
from lamina.strategies.pp.stages import StageRunner, join_inputs
from lamina.trace.pipeline_view import GRADIENT_SYNC, PIPELINE_TRACK, SCHEDULE
from lamina.trace.recorder import get_recorder

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class TiedWeight:
    """A weight two or more stages hold: its names and the group summing it."""

    name: str
    #: Every name the model registers it under (a stage holds it under some of them).
    names: tuple[str, ...]
    group: dist.ProcessGroup | None
    #: Whether this rank counts it in the gradient norm (the first stage holding it).
    counted_here: bool = True

    def param_in(self, model: nn.Module) -> nn.Parameter:
        """The parameter the model holds for it now (a sharding strategy composed after
        the pipeline swaps the model's parameters, for the step and after it)."""
        held = dict(model.named_parameters(remove_duplicate=False))
        return next(held[n] for n in self.names if n in held)


class StepSharding(Protocol):
    """Shards a pipelined model's stages over the other mesh axes (ZeRO-3 / HSDP composed
    after ``pp``; :class:`lamina.memory.whole_step.WholeStepGather`)."""

    @property
    def replicas(self) -> int:
        """Copies of each shard across the job's replica axes (1: none)."""

    def begin(self, train: bool = True) -> None:
        """Whole parameters in the modules for the step (gathered)."""

    def finish(self) -> None:
        """The step's summed gradients reduce-scattered into the shards' gradients."""

    def end(self) -> None:
        """The shards back in the modules, without any collective."""


@dataclass(frozen=True)
class StepPhases:
    """Where one pipelined step's time went on this rank, in seconds."""

    #: torch's schedule: the microbatches' forwards, backwards, sends and recvs, and the
    #: waits between them (the bubble).
    schedule_s: float
    #: After it: the microbatch mean, the replicas' average and the tied weights' sums.
    gradient_sync_s: float
    #: Inside the schedule: this rank's stages computing (their forward and backward
    #: chunks); the rest of ``schedule_s`` is transfers and waiting.
    compute_s: float = 0.0

    @property
    def bubble(self) -> float:
        """The fraction of the schedule this rank spent not computing."""
        return 1.0 - self.compute_s / self.schedule_s if self.schedule_s > 0 else 0.0


@dataclass
class PipelineEngine:
    """This rank's stages and the groups a step uses (see the module)."""

    runners: list[StageRunner]
    layout: PipelineLayout
    microbatches: int
    device: torch.device
    pipeline_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup | None
    ties: list[TiedWeight]
    #: The pruned model: its parameters now are this rank's stages' (whole ones during a
    #: sharded step, shards after it).
    model: nn.Module
    _schedules: dict[int, Any] = field(default_factory=dict)
    _stages: list[PipelineStage] | None = None
    _compute_s: float = 0.0
    #: The model's run log: each step opens its record (and the trace's step number).
    run_log: RunLog | None = None
    steps: int = 0
    #: The last step's phases on this rank (None before the first step).
    last_phases: StepPhases | None = None
    #: Shards the stages over the other axes (None: each rank holds its stages whole).
    sharding: StepSharding | None = None
    #: Parameters tensor parallelism splits (by name), and its degree (``tp`` composed
    #: before ``pp``: the other parameters are whole on every tp rank).
    tensor_split: frozenset[str] = frozenset()
    tensor_size: int = 1

    @property
    def params(self) -> list[nn.Parameter]:
        """This rank's stages' parameters, as the model holds them now."""
        return list(self.model.parameters())

    @property
    def holds_last(self) -> bool:
        return any(r.span.is_last for r in self.runners)

    def step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        input_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """One training step's forward and backward over the microbatches; the mean
        microbatch loss (on every rank). Gradients are left for the user's optimizer."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        self._check_batch("model.step", args, input_kwargs or {})
        schedule = self._schedule(loss_fn)
        losses: list[torch.Tensor] = []
        kwargs = join_inputs(args, input_kwargs or {})
        self._compute_s = 0.0
        if self.run_log is not None:
            self.run_log.begin_step()
        started = time.perf_counter()
        with self._whole_parameters(train=True) as sharding:
            before = {id(p): p.grad.clone() for p in self.params if p.grad is not None}
            with _traced(SCHEDULE):
                if self.holds_last:
                    schedule.step(**kwargs, target=targets, losses=losses, return_outputs=False)
                else:
                    schedule.step(**kwargs, return_outputs=False)
            scheduled = time.perf_counter()
            with _traced(GRADIENT_SYNC):
                self._mean_over_microbatches(before)
                self._average_replicas()
                self._sum_tied()
                if sharding is not None:
                    sharding.finish()
        synced = time.perf_counter() - scheduled
        if self.run_log is not None:
            self.run_log.end_backward()  # the step's gradients are synced: it counts
        self.last_phases = StepPhases(scheduled - started, synced, self._compute_s)
        self.steps += 1
        return self._loss(losses)

    def evaluate(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        input_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """The mean microbatch loss of one batch, forward only: no graph, no gradients."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        self._check_batch("model.evaluate", args, input_kwargs or {})
        schedule = self._schedule(loss_fn)
        losses: list[torch.Tensor] = []
        kwargs = join_inputs(args, input_kwargs or {})
        with torch.no_grad(), self._whole_parameters(train=False):
            if self.holds_last:
                schedule.eval(**kwargs, target=targets, losses=losses)
            else:
                schedule.eval(**kwargs)
        return self._loss(losses)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every stage's gradients so that the whole model's gradient norm (as
        ``torch.nn.utils.clip_grad_norm_`` computes it in one process, a tied weight
        once) is at most ``max_norm``; that norm before scaling. Each rank sums its
        pieces' squares (a stage's whole parameters, tensor-parallel slices, shards),
        each divided by the number of ranks holding that same piece, over the job."""
        skipped = {id(t.param_in(self.model)) for t in self.ties if not t.counted_here}
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, p in self.model.named_parameters():
            if p.grad is not None and id(p) not in skipped:
                square = _local(p.grad).detach().float().pow(2).sum()
                squares += square / self._copies(name)
        dist.all_reduce(squares)
        total = squares.sqrt()
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.params:
            if p.grad is not None:
                _local(p.grad).mul_(scale.to(p.grad.dtype))
        return total

    def _copies(self, name: str) -> int:
        """Ranks holding the same piece of parameter ``name`` as this one: the replicas
        (pipelines, or a sharder's replica axes), times the tensor-parallel ranks where
        they hold it whole."""
        if self.sharding is not None:
            replicas = self.sharding.replicas
        else:
            replicas = 1 if self.replica_group is None else dist.get_world_size(self.replica_group)
        return replicas * (1 if name in self.tensor_split else self.tensor_size)

    @contextmanager
    def _whole_parameters(self, train: bool) -> Iterator[StepSharding | None]:
        """The stages' whole parameters for the block where they are sharded (the
        sharding, else None); the shards come back at its end, with no collective (a
        training step calls ``finish()`` inside it to give them their gradients)."""
        sharding = self.sharding
        if sharding is None:
            yield None
            return
        sharding.begin(train)
        try:
            yield sharding
        finally:
            sharding.end()

    def _check_batch(self, caller: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        batch = _batch_size(args, kwargs)
        if batch % self.microbatches:
            raise ConfigError(
                f"{caller}: a batch of {batch} does not split into {self.microbatches} "
                "microbatches; make the batch a multiple of microbatches="
            )

    def _schedule(self, loss_fn: LossFn) -> Any:
        key = id(loss_fn)
        if key not in self._schedules:
            if self._stages is None:
                self._stages = [
                    PipelineStage(
                        runner,
                        runner.span.index,
                        runner.span.count,
                        self.device,
                        group=self.pipeline_group,
                    )
                    for runner in self.runners
                ]
                for stage in self._stages:
                    self._time_chunks(stage)
            kind = self.layout.schedule
            held: Any = self._stages if kind.multi else self._stages[0]
            self._schedules.clear()  # one loss at a time: torch's stages keep one schedule
            self._schedules[key] = kind.torch_class(
                held, self.microbatches, loss_fn=loss_fn, scale_grads=False
            )
        return self._schedules[key]

    def _time_chunks(self, stage: PipelineStage) -> None:
        """Count the time ``stage`` spends in its forward and backward chunks (traced as
        compute spans: ``stage 1 forward``)."""
        for name, what in CHUNKS.items():
            run = getattr(stage, name, None)
            if run is not None:
                setattr(stage, name, self._timed(run, f"stage {stage.stage_index} {what}"))

    def _timed(self, run: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                with _traced(label, "compute"):
                    return run(*args, **kwargs)
            finally:
                self._compute_s += time.perf_counter() - started

        return timed

    def _mean_over_microbatches(self, before: dict[int, torch.Tensor]) -> None:
        """The step's gradient as the mean over its microbatches, added to what was
        there before (each local parameter once: a weight two local stages share too)."""
        for p in self.params:
            if p.grad is None:
                continue
            earlier = before.get(id(p))
            if earlier is None:
                p.grad.div_(self.microbatches)
            else:
                p.grad.sub_(earlier).div_(self.microbatches).add_(earlier)

    def _sum_tied(self) -> None:
        """Each tied weight's gradient summed over the stages holding it. With several
        pipelines this runs after their average, so every pipeline holds the same
        gradients: each sums its share (1/R of the weight, R pipelines) over the pipeline
        axis and the replicas gather the shares, so 1/R of the bytes cross that axis."""
        for tie in self.ties:
            if tie.group is None:
                continue
            param = tie.param_in(self.model)
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            if self.replica_group is None:
                dist.all_reduce(grad, group=tie.group)
                continue
            parts = dist.get_world_size(self.replica_group)
            share = tied_share(grad.numel(), parts)
            padded = torch.zeros(share * parts, dtype=grad.dtype, device=grad.device)
            padded[: grad.numel()] = grad.reshape(-1)
            mine = padded[share * self._replica_index : share * (self._replica_index + 1)]
            dist.all_reduce(mine, group=tie.group)
            gathered = [torch.empty_like(mine) for _ in range(parts)]
            dist.all_gather(gathered, mine, group=self.replica_group)
            grad.copy_(torch.cat(gathered)[: grad.numel()].view_as(grad))

    @property
    def _replica_index(self) -> int:
        """This rank's place among the pipelines replicating its stages."""
        return dist.get_rank(self.replica_group)

    def _average_replicas(self) -> None:
        group = self.replica_group
        if group is None:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        size = dist.get_world_size(group)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=group)
            flat /= size
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _loss(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        value = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            value = torch.stack([loss.detach().float() for loss in losses]).mean()
        last = self.layout.pipeline[self.layout.holder(self.layout.stage_count - 1)]
        dist.broadcast(value, src=last, group=self.pipeline_group)
        return value


#: torch's stage methods that compute, and what a trace calls them.
CHUNKS = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "backward (weights)",
}


@contextmanager
def _traced(name: str, track: str = PIPELINE_TRACK) -> Iterator[None]:
    """A span of the trace around the block, when a trace is recording."""
    recorder = get_recorder()
    if recorder is None:
        yield
        return
    with recorder.span(track, name):
        yield


def tied_share(numel: int, parts: int) -> int:
    """Elements of a tied weight's gradient each of ``parts`` pipelines sums (the last
    share padded)."""
    return -(-numel // parts)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (a sharded parameter's gradient), else the tensor."""
    local: torch.Tensor = getattr(tensor, "_local_tensor", tensor)
    return local


def _batch_size(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ConfigError("model.step: no input tensor to split into microbatches; pass the batch")
