"""What running a plan did: collectives issued per step and fallbacks taken at run time."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from lamina.errors import ConfigError
from lamina.runtime.nodes import Transfer
from lamina.runtime.plan import ExecutionPlan
from lamina.trace.events import SpanEvent
from lamina.trace.recorder import IssueHandle, get_recorder
from lamina.units import format_bytes

logger = logging.getLogger("lamina.runtime")


@dataclass(frozen=True)
class FallbackEvent:
    """A run-time fallback: ``node`` switched from ``primary`` to ``alternative``."""

    step: int
    node: str
    primary: str
    alternative: str
    reason: str


@dataclass
class StepRecord:
    """Collectives one step issued (by node id) and the bytes they moved; a pipeline's
    sends and recvs (by their ``send`` / ``recv`` node ids) apart from them."""

    step: int
    issued: Counter[str] = field(default_factory=Counter)
    nbytes: int = 0
    #: Point-to-point sends and recvs issued, by plan node id, and their bytes by node.
    transfers: Counter[str] = field(default_factory=Counter)
    transfer_bytes: Counter[str] = field(default_factory=Counter)
    fallbacks: list[FallbackEvent] = field(default_factory=list)
    #: A backward that synchronizes gradients ended in this step (with one rank, where
    #: nothing is issued, this is what ends a step; under ``no_sync`` nothing does).
    synced: bool = False
    #: Times a compiled step was compiled again in this step (a new input shape).
    recompiles: int = 0


class RunLog:
    """Per-step record of running ``plan``; every issued collective names its plan node.

    When a trace recorder is active (``$LAMINA_TRACE``) every collective and the
    forward / backward intervals also go to it.
    """

    def __init__(self, plan: ExecutionPlan) -> None:
        self.plan = plan
        self.events: list[FallbackEvent] = []
        self.current = StepRecord(step=0)
        self.last: StepRecord | None = None
        self._backward: SpanEvent | None = None
        #: Recompilations of a compiled step over the run (each also in its step).
        self.recompiles = 0
        #: Each compiled shape's first step in words: its seconds, cold or warm, and which
        #: ranks compiled its graph (shown by :meth:`summary` in every step).
        self.first_steps: list[str] = []

    def begin_step(self) -> None:
        """Close the current step (if it issued anything or synchronized a backward) and
        open the next one; forwards of micro-batches under ``no_sync`` stay one step."""
        current = self.current
        if current.issued or current.transfers or current.fallbacks or current.synced:
            self.last = self.current
            self.current = StepRecord(step=self.current.step + 1)
        recorder = get_recorder()
        if recorder is not None:
            recorder.step = self.current.step

    @contextmanager
    def collective(
        self, node_id: str, nbytes: int | None = None, wire: dict[str, int] | None = None
    ) -> Iterator[IssueHandle]:
        """Around issuing the collective of ``node_id``: counts it and traces it (the
        caller sets ``handle.work`` to the async work it got, if any). ``nbytes`` is its
        size as the op counts it (default: the plan's), ``wire`` the bytes per dtype it
        hands to ``torch.distributed`` over all its calls (default: one call of
        ``nbytes`` in the plan's wire dtype); a codec or an algorithm in phases passes
        both."""
        self.issued(node_id, nbytes)
        recorder = get_recorder()
        spec = self.plan.node(node_id).collective
        if recorder is None or spec is None:
            yield IssueHandle(None)
            return
        size = spec.nbytes if nbytes is None else nbytes
        dtype = spec.wire_dtype or spec.dtype
        with recorder.collective(
            op=spec.op,
            group=spec.group,
            dtype=dtype,
            numel=spec.numel,
            nbytes=size,
            node=node_id,
            wire={dtype: size} if wire is None else wire,
        ) as handle:
            yield handle

    @contextmanager
    def compute(self, name: str) -> Iterator[None]:
        """A traced compute interval (``forward``) around the block."""
        recorder = get_recorder()
        if recorder is None:
            yield
            return
        with recorder.span("compute", name):
            yield

    def begin_backward(self) -> None:
        """Backward started producing gradients (traced as a compute span)."""
        recorder = get_recorder()
        if recorder is not None and self._backward is None:
            self._backward = recorder.begin_span("compute", "backward")

    def end_backward(self) -> None:
        """Backward's computation ended (its collectives may still be in flight)."""
        self.current.synced = True
        span, self._backward = self._backward, None
        if span is not None:
            span.end_ns = time.time_ns()

    def issued(self, node_id: str, nbytes: int | None = None) -> None:
        """Record that the collective of ``node_id`` was issued (it must be planned)."""
        node = self.plan.node(node_id)
        if node.collective is None:
            raise ConfigError(f"plan node {node_id!r} is not a collective; fix the engine")
        self.current.issued[node_id] += 1
        self.current.nbytes += node.collective.nbytes if nbytes is None else nbytes

    def transfer(self, node_id: str, nbytes: int | None = None) -> None:
        """Record that the send or recv of ``node_id`` (a planned pipeline transfer) was
        issued, moving ``nbytes`` (default: the plan's)."""
        node = self.plan.node(node_id)
        if not isinstance(node.detail, Transfer):
            raise ConfigError(f"plan node {node_id!r} is not a send or recv; fix the engine")
        self.current.transfers[node_id] += 1
        self.current.transfer_bytes[node_id] += node.detail.nbytes if nbytes is None else nbytes

    def recompiled(self) -> None:
        """A compiled step was compiled again (a new input shape) in the current step."""
        self.current.recompiles += 1
        self.recompiles += 1

    def compiled(self, words: str) -> None:
        """A compiled step's new input shape ran its first step: ``words`` says its
        seconds and how its graph was compiled (``41.2 s (cold: compiled on rank 0...)``)."""
        self.first_steps.append(words)

    def fallback(self, node_id: str, alternative: str, reason: str) -> FallbackEvent:
        """Record a run-time fallback declared on ``node_id``; logs it once per kind."""
        declared = [
            f
            for f in self.plan.fallbacks_of(node_id)
            if f.alternative == alternative and f.when == "run"
        ]
        if not declared:
            raise ConfigError(
                f"plan node {node_id!r} declares no run-time fallback to {alternative!r}"
            )
        event = FallbackEvent(self.current.step, node_id, declared[0].primary, alternative, reason)
        first = not any(e.node == node_id and e.alternative == alternative for e in self.events)
        self.events.append(event)
        self.current.fallbacks.append(event)
        if first:
            logger.warning(
                "fallback on %s: %s -> %s (%s)", node_id, event.primary, alternative, reason
            )
        return event

    def summary(self) -> str:
        """One line about the step in progress (or, before it issues anything, the last)."""
        record = self.current if self.current.issued or self.last is None else self.last
        planned = [n.id for n in self.plan.collectives() if n.phase != "setup"]
        done = sum(1 for n in planned if record.issued.get(n))
        parts = [
            f"step {record.step}: {done}/{len(planned)} planned collectives, "
            f"{sum(record.issued.values())} issued, {format_bytes(record.nbytes)}"
        ]
        if record.transfers:
            moved = format_bytes(sum(record.transfer_bytes.values()))
            parts.append(f"{sum(record.transfers.values())} sends/recvs, {moved}")
        chosen = dict(self.plan.meta).get("auto")
        if chosen:
            parts.append(f"auto chose {chosen}")
        plan_taken = Counter(
            f"{f.primary} -> {f.alternative}" for f in self.plan.fallbacks if f.taken
        )
        if plan_taken:
            parts.append(
                "plan fallbacks: " + "; ".join(f"{k} (x{n})" for k, n in plan_taken.items())
            )
        if record.recompiles:
            parts.append(f"recompiled x{record.recompiles} ({self.recompiles} in the run)")
        if self.first_steps:
            first, *others = self.first_steps
            parts.append(f"first step: {first}" + "".join(f"; new shape: {o}" for o in others))
        if record.fallbacks:
            parts.append(
                "run fallbacks: "
                + "; ".join(
                    f"{e.node} {e.primary} -> {e.alternative} ({e.reason})"
                    for e in record.fallbacks
                )
            )
        return " | ".join(parts)
