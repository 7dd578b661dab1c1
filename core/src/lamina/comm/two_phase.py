"""What every two-phase codec shares: the sum's contract, its statistics, the channel the
sums run on and the gather of the second phase.

A collective cannot sum a quantized payload (fp8, int8 with block scales), so a two-phase
codec sums in its own collectives (and reduce-scatters, for ZeRO-3, in the first phase
alone: :class:`TwoPhaseScatter`): each rank quantizes its buffer, an ``all_to_all``
hands rank ``r`` the ``r``-th chunk of every rank's payload (the reduce-scatter phase),
rank ``r`` decodes and sums its chunk, quantizes the sum again, and every rank gathers the
quantized chunks (the all-gather phase). The codec (``lamina.comm.codecs.TwoPhaseCodec``)
makes one :class:`TwoPhaseSum` per bucket; the reducer runs it on a
:class:`TwoPhaseChannel` and knows nothing else of the codec. A rank that must not send
its quantized buffer (not finite, past a bound) writes a NaN that survives the sum and
the gather, so every rank decodes a non-finite result in the same step and takes the
same fallback, without an extra collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lamina.works import AllWorks, SerialWorker


@dataclass
class QuantizationCounts:
    """What quantizing lost: non-finite inputs (``overflow``: they cannot be encoded and
    decode as NaN) and nonzero inputs that became zero (``underflow``)."""

    overflow: int = 0
    underflow: int = 0

    def add(self, other: QuantizationCounts) -> None:
        """Add ``other``'s counts to these."""
        self.overflow += other.overflow
        self.underflow += other.underflow


@dataclass
class SumStats:
    """What one rank saw in one two-phase sum: quantization counts over both phases, the
    relative L2 error of quantizing its contribution (``error_in``) and its summed chunk
    (``error_out``), and why it flagged the bucket for the fallback ('' if it did not)."""

    counts: QuantizationCounts = field(default_factory=QuantizationCounts)
    error_in: float = 0.0
    error_out: float = 0.0
    flagged: str = ""

    def as_dict(self) -> dict[str, float | int | str]:
        """For the trace."""
        return {
            "overflow": self.counts.overflow,
            "underflow": self.counts.underflow,
            "error_in": self.error_in,
            "error_out": self.error_out,
            "flagged": self.flagged,
        }


def merged_stats(stats: Sequence[SumStats]) -> SumStats:
    """One bucket's statistics over its sums (the chunks of a pipelined bucket)."""
    out = SumStats()
    for one in stats:
        out.counts.add(one.counts)
        out.error_in = max(out.error_in, one.error_in)
        out.error_out = max(out.error_out, one.error_out)
        out.flagged = out.flagged or one.flagged
    return out


class TwoPhaseSum(Protocol):
    """The two-phase sum of one buffer, step after step (its error feedback included)."""

    def run(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The sum of the 1-D float ``tensor`` over ``group``: a new fp32 tensor whose first
        ``tensor.numel()`` elements are the sum (bitwise equal on every rank), non-finite
        where a rank flagged. ``tensor`` is not written."""

    def commit(self, ok: bool) -> None:
        """Keep the last :meth:`run`'s residuals (``ok``: its result was used) or drop
        them (the bucket was reduced exactly instead)."""

    def stats(self) -> SumStats:
        """What the last :meth:`run` saw on this rank (may wait for the device)."""

    def residual_nbytes(self) -> int:
        """Bytes of the error-feedback residuals held now."""


class TwoPhaseScatter(Protocol):
    """The first phase alone, step after step: the reduce-scatter of one buffer of ``P``
    rank-major slots (ZeRO-3's gradient), with its error feedback."""

    def start(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> tuple[Any, Callable[[], torch.Tensor]]:
        """Start summing the ``P`` slots of the 1-D ``tensor`` over ``group``: the work, and
        a function giving this rank's summed slot (fp32, ``numel / P``), non-finite in
        every slot where a rank flagged."""

    def commit(self, ok: bool) -> None:
        """Keep (``ok``) or drop the last call's residual."""

    def stats(self) -> SumStats:
        """What the last :meth:`start` saw on this rank."""

    def residual_nbytes(self) -> int:
        """Bytes of the residual held now."""


def all_gather_slots(
    out: torch.Tensor, part: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup | None
) -> None:
    """``out`` <- every rank's ``part`` in rank order (one broadcast per rank on gloo,
    whose all_gather is the slower form; the native op elsewhere)."""
    if dist.get_backend(group) != "gloo":
        dist.all_gather_into_tensor(out, part, group=group)
        return
    slots = out.view(world, part.numel())
    slots[rank].copy_(part)
    works = [
        dist.broadcast(
            slot,
            src=k if group is None else dist.get_global_rank(group, k),
            group=group,
            async_op=True,
        )
        for k, slot in enumerate(slots)
    ]
    for work in works:
        work.wait()  # type: ignore[union-attr]


class TwoPhaseChannel:
    """Where a group's two-phase sums run: a process group of their own over ``ranks``
    (the sums are several collectives each, issued apart from the bucket all-reduces)
    and, on gloo, one thread that issues them in submission order on every rank."""

    def __init__(self, ranks: Sequence[int], pg_backend: str) -> None:
        whole_job = len(ranks) == dist.get_world_size()
        self.group = dist.new_group(list(ranks), use_local_synchronization=not whole_job)
        self.worker = SerialWorker("lamina-two-phase") if pg_backend == "gloo" else None

    def submit(self, run: Callable[[], None]) -> Any:
        """Run ``run`` (on the worker thread on gloo, else now, in stream order); returns a
        work to wait on."""
        if self.worker is not None:
            return self.worker.submit(run)
        run()
        return AllWorks([])

    def close(self) -> None:
        """Stop the worker thread."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
