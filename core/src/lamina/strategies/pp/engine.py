"""What runs a pipelined step (:class:`PipelineEngine`): torch's schedule over this
rank's stages, then the gradient all-reduces the plan lists (the replicas' average, then
each tied weight's sum over its stages, split among the replicas), then the loss handed
to every rank of the pipeline. Where ZeRO-3 or HSDP shards the stages over the other
axes (composed after ``pp``), a :class:`StepSharding` gathers them for the whole step
and reduce-scatters the summed gradients after it, in place of the replicas' average.

Each training step records what ran on this rank: every send and recv the schedule
issues (through the stages' P2P op getters) and every collective after it, by plan node
(:mod:`.plan_nodes`), in the model's run log, and the order of its stages' compute
chunks in :attr:`PipelineEngine.last_actions`."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lamina.errors import ConfigError
from lamina.runtime.log import RunLog
from lamina.strategies.pp.layout import PipelineLayout
from lamina.strategies.pp.plan_nodes import LOSS, average_id, stage_node_id, tied_id
from lamina.strategies.pp.stages import StageRunner, join_inputs
from lamina.strategies.surface import STEP_SHARDING_KEY, STEP_SYNCS_KEY
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
    #: The pipeline ranks holding it (its stages' ranks), each with the same gradient
    #: after the step's sum (the gradient norm counts it once: its placement says so).
    holders: tuple[int, ...] = ()

    def param_in(self, model: nn.Module) -> nn.Parameter:
        """The parameter the model holds for it now (a sharding strategy composed after
        the pipeline swaps the model's parameters, for the step and after it)."""
        held = dict(model.named_parameters(remove_duplicate=False))
        return next(held[n] for n in self.names if n in held)


class StepSharding(Protocol):
    """Shards a pipelined model's stages over the other mesh axes (ZeRO-3 / HSDP composed
    after ``pp``; :class:`lamina.memory.whole_step.WholeStepGather`)."""

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
    #: The compute chunks this rank's stages ran in the last training step, in order:
    #: forward (``F``), backward (``B``; under ZBV its input half ``I``, then its weight
    #: half ``W``), by stage and microbatch.
    last_actions: list[ChunkAction] = field(default_factory=list)
    #: Whether a training step is running (its chunks and transfers are recorded).
    _recording: bool = False
    #: The last step's phases on this rank (None before the first step).
    last_phases: StepPhases | None = None

    @property
    def sharding(self) -> StepSharding | None:
        """What shards the stages over the other axes (a sharder composed after ``pp``
        declares it on the model when it builds; None: each rank holds its stages whole)."""
        held: StepSharding | None = self.model.__dict__.get(STEP_SHARDING_KEY)
        return held

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
        self.last_actions = []
        if self.run_log is not None:
            self.run_log.begin_step()
        started = time.perf_counter()
        self._recording = True  # the chunks, sends, recvs and collectives go to the log
        try:
            with self._whole_parameters(train=True) as sharding:
                before = {id(p): p.grad.clone() for p in self.params if p.grad is not None}
                with _traced(SCHEDULE):
                    kwargs |= _no_outputs(schedule)
                    if self.holds_last:
                        schedule.step(**kwargs, target=targets, losses=losses)
                    else:
                        schedule.step(**kwargs)
                scheduled = time.perf_counter()
                with _traced(GRADIENT_SYNC):
                    self._mean_over_microbatches(before)
                    self._average_replicas()
                    self._sum_tied(before)
                    if sharding is not None:
                        sharding.finish()
            with _traced(GRADIENT_SYNC):
                for sync in self.model.__dict__.get(STEP_SYNCS_KEY, ()):
                    sync()  # an earlier strategy's (ep's), on the shards the model holds now
            synced = time.perf_counter() - scheduled
            if self.run_log is not None:
                self.run_log.end_backward()  # the step's gradients are synced: it counts
            self.last_phases = StepPhases(scheduled - started, synced, self._compute_s)
            self.steps += 1
            return self._loss(losses)
        finally:
            self._recording = False

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
                    self._record_transfers(stage)
            kind = self.layout.schedule
            held: Any = self._stages if kind.multi else self._stages[0]
            self._schedules.clear()  # one loss at a time: torch's stages keep one schedule
            self._schedules[key] = kind.torch_class(
                held, self.microbatches, loss_fn=loss_fn, scale_grads=False
            )
        return self._schedules[key]

    @property
    def pipeline_stages(self) -> list[PipelineStage]:
        """torch's ``PipelineStage`` of each local stage (built by the first step)."""
        return list(self._stages or ())

    def _time_chunks(self, stage: PipelineStage) -> None:
        """Count the time ``stage`` spends in its forward and backward chunks (traced as
        compute spans: ``stage 1 forward``); in a training step, each chunk it runs goes
        to :attr:`last_actions`."""
        for name, what in CHUNKS.items():
            run = getattr(stage, name, None)
            if run is not None:
                setattr(stage, name, self._timed(run, stage.stage_index, name, what))

    def _timed(
        self, run: Callable[..., Any], stage: int, name: str, what: str
    ) -> Callable[..., Any]:
        label = f"stage {stage} {what}"
        signature = inspect.signature(run)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._recording:
                self.last_actions.append(_chunk_action(name, stage, signature, args, kwargs))
            started = time.perf_counter()
            try:
                with _traced(label, "compute"):
                    return run(*args, **kwargs)
            finally:
                self._compute_s += time.perf_counter() - started

        return timed

    def _record_transfers(self, stage: PipelineStage) -> None:
        """Each send and recv torch's schedule asks ``stage`` for (its P2P op getters,
        one op per tensor of a microbatch) recorded in the run log, in a training step,
        by the plan's transfer node; the schedule still issues them itself."""
        for name, what in P2P_GETTERS.items():
            get = getattr(stage, name)
            setattr(stage, name, self._recorded(get, stage.stage_index, what))

    def _recorded(
        self, get: Callable[[int], list[dist.P2POp]], stage: int, what: str
    ) -> Callable[[int], list[dist.P2POp]]:
        def ops(chunk: int) -> list[dist.P2POp]:
            out = get(chunk)
            log = self.run_log
            if self._recording and log is not None:
                for op in out:
                    nbytes = op.tensor.numel() * op.tensor.element_size()
                    log.transfer(stage_node_id(stage, chunk, what), nbytes)
            return out

        return ops

    @contextmanager
    def _issuing(self, node_id: str, nbytes: int) -> Iterator[None]:
        """Around a collective of the plan's ``node_id`` (``nbytes`` as it goes): in a
        training step, recorded in the run log (and the trace)."""
        log = self.run_log
        if not self._recording or log is None:
            yield
            return
        with log.collective(node_id, nbytes):
            yield

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

    def _sum_tied(self, before: dict[int, torch.Tensor]) -> None:
        """Each tied weight's gradient of this step summed over the stages holding it,
        what it held before the step (the same on each of them: the last step summed it)
        added back once. With several pipelines this runs after their average, so every
        pipeline holds the same gradients: each sums its share (1/R of the weight, R
        pipelines) over the pipeline axis and the replicas gather the shares, so 1/R of
        the bytes cross that axis."""
        for tie in self.ties:
            if tie.group is None:
                continue
            param = tie.param_in(self.model)
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            earlier = before.get(id(param))
            added = grad if earlier is None else grad - earlier
            self._sum_over_holders(tie, added)
            if earlier is not None:
                grad.copy_(added.add_(earlier))

    def _sum_over_holders(self, tie: TiedWeight, grad: torch.Tensor) -> None:
        """``grad`` (a tied weight's, in place) summed over the ranks holding it."""
        parts = self._replica_count
        if parts == 1:
            with self._issuing(tied_id(tie.name), _nbytes(grad)):
                dist.all_reduce(grad, group=tie.group)
            return
        share = tied_share(grad.numel(), parts)
        padded = torch.zeros(share * parts, dtype=grad.dtype, device=grad.device)
        padded[: grad.numel()] = grad.reshape(-1)
        mine = padded[share * self._replica_index : share * (self._replica_index + 1)]
        with self._issuing(tied_id(tie.name), _nbytes(mine)):
            dist.all_reduce(mine, group=tie.group)
        gathered = [torch.empty_like(mine) for _ in range(parts)]
        with self._issuing(tied_id(tie.name, self.layout.pipeline_rank), _nbytes(padded)):
            dist.all_gather(gathered, mine, group=self.replica_group)
        grad.copy_(torch.cat(gathered)[: grad.numel()].view_as(grad))

    @property
    def _replica_count(self) -> int:
        """The pipelines whose gradients this one averages with (1: none)."""
        group = self.replica_group
        return 1 if group is None else dist.get_world_size(group)

    @property
    def _replica_index(self) -> int:
        """This rank's place among the pipelines replicating its stages."""
        return dist.get_rank(self.replica_group)

    def _average_replicas(self) -> None:
        size = self._replica_count
        if size == 1:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        node = average_id(self.layout.pipeline_rank)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            with self._issuing(node, _nbytes(flat)):
                dist.all_reduce(flat, group=self.replica_group)
            flat /= size
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _loss(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        value = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            value = torch.stack([loss.detach().float() for loss in losses]).mean()
        if self.layout.size == 1:  # the one rank holds the last stage
            return value
        last = self.layout.pipeline[self.layout.holder(self.layout.stage_count - 1)]
        with self._issuing(LOSS, _nbytes(value)):
            dist.broadcast(value, src=last, group=self.pipeline_group)
        return value


class ChunkAction(NamedTuple):
    """One compute chunk a stage ran: ``kind`` as torch's schedules write it (``F``
    forward, ``B`` full backward, ``I`` / ``W`` a backward's input / weight half), the
    stage and the microbatch."""

    kind: str
    stage: int
    microbatch: int


def _chunk_action(
    name: str, stage: int, signature: inspect.Signature, args: Any, kwargs: Any
) -> ChunkAction:
    """The action a call of the stage's chunk method ``name`` runs."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    if name == "forward_one_chunk":
        return ChunkAction("F", stage, int(given["fwd_chunk_id"]))
    if name == "backward_one_chunk":
        kind = "B" if given.get("full_backward", True) else "I"
        return ChunkAction(kind, stage, int(given["bwd_chunk_id"]))
    return ChunkAction("W", stage, int(given["bwd_chunk_id"]))


#: torch's ``PipelineStage`` P2P op getters, and the plan's transfer each one's ops are.
P2P_GETTERS = {
    "get_fwd_send_ops": "send_act",
    "get_fwd_recv_ops": "recv_act",
    "get_bwd_send_ops": "send_grad",
    "get_bwd_recv_ops": "recv_grad",
}


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


def _no_outputs(schedule: Any) -> dict[str, Any]:
    """The keyword telling torch's schedule not to keep the last stage's outputs, where
    its ``step`` takes it (torch 2.13's does; torch 2.9's hands every keyword to the
    model)."""
    accepts = "return_outputs" in inspect.signature(schedule.step).parameters
    return {"return_outputs": False} if accepts else {}


def tied_share(numel: int, parts: int) -> int:
    """Elements of a tied weight's gradient each of ``parts`` pipelines sums (the last
    share padded)."""
    return -(-numel // parts)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _batch_size(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ConfigError("model.step: no input tensor to split into microbatches; pass the batch")
