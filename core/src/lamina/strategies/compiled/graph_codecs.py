"""A two-phase codec's sum (fp8, int8, a plugin's) inside a captured step.

What :class:`~lamina.comm.reducer.GradientReducer` runs for a bucket with a two-phase
codec (the codec's ``TwoPhaseSum``), written with traceable operations so a compiled
step holds it. The codec gives its block quantization for a graph
(:meth:`TwoPhaseCodec.traced <lamina.comm.codecs.TwoPhaseCodec.traced>`: a
:class:`~lamina.comm.codecs.TracedBlocks`, the same math as its eager sum); this module
runs the two phases around it as functional collectives:

1. each rank adds its residual to its (averaged) bucket, padded to ``P`` chunks of
   whole blocks, quantizes it and flags it as the eager sum does (input not finite, a
   magnitude past ``overflow_at``, a quantization error past ``error_bound``);
2. ``all_to_all`` of the payload and of the scales (fp8's ``uint8`` bits travel as
   they do on gloo);
3. the ``P`` received chunks decoded and summed in fp32 (the eager sum's order), the
   summed chunk quantized again with the owned residual and flagged;
4. the gather of the payload and of the scales (one broadcast per rank on gloo, as
   :func:`~lamina.comm.two_phase.all_gather_slots` does; ``all_gather`` elsewhere),
   decoded on every rank: the same bits everywhere.

The result is used where it is finite; otherwise (a rank flagged the bucket) the graph
reduces the bucket exactly as the codec's ``fallback`` says (``torch.cond``: that
all-reduce runs only in such a step, as the eager reducer's does). The error-feedback
residuals are the eager sum's own tensors, graph inputs overwritten in place: kept where
the result was used, left as they were where it was not, so they carry across replays
and across eager and compiled steps alike. :func:`two_phase_calls` lists the calls a sum
issues, for the check of the captured graph against the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

from lamina.comm.codecs import Codec, TracedBlocks, TwoPhaseCodec
from lamina.comm.two_phase import TwoPhaseSum
from lamina.runtime.nodes import CodecFact
from lamina.strategies.compiled.graph_algorithms import gather_calls
from lamina.strategies.compiled.graph_collectives import PlannedCall

#: Columns of a compiled step's codec flags: the sum was not used (the bucket fell
#: back), and this rank flagged it.
NOT_USED, FLAGGED_HERE = 0, 1


def untraced_reason(node: str, fact: CodecFact, codec: Codec | None) -> str:
    """'' when a captured graph can sum ``node``'s bucket with ``codec`` (the plan's
    ``fact``); else why not, naming the codec."""
    if fact.scope != "all":
        return (
            f"bucket node {node} has codec {fact.name} on its inter-host phase "
            f"(codec_scope={fact.scope!r}), which the graph does not issue"
        )
    if not isinstance(codec, TwoPhaseCodec) or codec.name != fact.name:
        return f"bucket node {node} has codec {fact.name}, which is not summed in the graph"
    if codec.traced() is None:
        return (
            f"bucket node {node} has codec {fact.name}, which gives no traced sum "
            "(TwoPhaseCodec.traced)"
        )
    return ""


def padded_numel(numel: int, world: int, block: int) -> int:
    """``numel`` padded to ``world`` chunks of whole blocks (as the two-phase sums pad)."""
    unit = world * block
    return -(-numel // unit) * unit


def two_phase_calls(
    node: str, numel: int, world: int, block: int, native: bool
) -> list[PlannedCall]:
    """The calls of :func:`two_phase_mean` of a ``numel``-element bucket over ``world``
    ranks: the payload's and the scales' ``all_to_all``, then their gathers (the
    fallback's all-reduce is not among them: it runs only in a step a rank flags)."""
    padded = padded_numel(numel, world, block)
    blocks = padded // block
    return [
        PlannedCall(node, "all_to_all", padded),
        PlannedCall(node, "all_to_all", blocks),
        *gather_calls(node, world, padded // world, native),
        *gather_calls(node, world, blocks // world, native),
    ]


@dataclass(frozen=True)
class _Side:
    """One quantization of a sum: the wire tensors (flagged), the new residual and the
    flag."""

    payload: torch.Tensor
    scales: torch.Tensor
    residual: torch.Tensor
    flag: torch.Tensor


def _quantized(traced: TracedBlocks, values: torch.Tensor, residual: torch.Tensor | None) -> _Side:
    """``values`` (plus ``residual``) quantized and flagged as the eager sums'
    ``quantize_side`` does; the residual is what quantizing lost."""
    if residual is not None:
        values = values + residual
    payload, scales = traced.quantize(values)
    low, high = torch.aminmax(values)  # NaN when any value is
    largest = torch.maximum(-low, high)
    norm = values.norm()
    lost = values - traced.dequantize(payload, scales)
    error = torch.where(norm > 0, lost.norm() / norm, torch.zeros_like(norm))
    flag = ~torch.isfinite(largest) | (largest > traced.overflow_at) | (error > traced.error_bound)
    payload, scales = traced.flagged(payload, scales, flag)
    return _Side(payload, scales, lost, flag)


def _exactly(
    fallback: str, group: dist.ProcessGroup
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The branch of a flagged step: the bucket all-reduced in ``fallback``'s dtype."""

    def reduce(result: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        wire = flat if fallback == "fp32" else flat.to(torch.bfloat16)
        summed: torch.Tensor = funcol.all_reduce(wire, "sum", group)
        return summed.to(flat.dtype)

    return reduce


def _gathered(
    part: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup, native: bool
) -> torch.Tensor:
    """Every rank's ``part`` in rank order: ``all_gather``, or one broadcast per rank
    (gloo), as :func:`~lamina.comm.two_phase.all_gather_slots` gathers. ``rank`` and
    ``world`` are read before the capture: the graph asks ``torch.distributed`` nothing
    (a process group made later would make it compile again)."""
    if native:
        gathered: torch.Tensor = funcol.all_gather_tensor(part, 0, group)
        return gathered
    slots = [  # the source is the group's rank k
        funcol.broadcast(part if k == rank else torch.zeros_like(part), k, group)
        for k in range(world)
    ]
    return torch.cat(slots)


def _used(result: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The branch of a step no rank flagged: the decoded sum, in the bucket's dtype."""
    return result[: flat.numel()].to(flat.dtype).clone()


def two_phase_mean(
    coded: GraphCodec,
    flat: torch.Tensor,
    residuals: tuple[torch.Tensor, torch.Tensor] | None,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over ``group`` of the 1-D bucket ``flat`` (already divided by the group's
    size: the mean) through the two phases of ``coded``'s codec (see the module
    docstring), and its flags (:data:`NOT_USED`, :data:`FLAGGED_HERE`). ``residuals``
    (contribution, owned chunk; None without error feedback) are overwritten in place
    with this step's where the sum was used."""
    traced, world, rank, native = coded.traced, coded.world, coded.rank, coded.native
    block = traced.block
    numel = flat.numel()
    padded = padded_numel(numel, world, block)
    source = F.pad(flat.float(), (0, padded - numel))
    residual, owned = residuals if residuals is not None else (None, None)
    mine = _quantized(traced, source, residual)
    payload = funcol.all_to_all_single(mine.payload, None, None, group)
    scales = funcol.all_to_all_single(mine.scales, None, None, group)
    summed = traced.dequantize(payload, scales).view(world, padded // world).sum(dim=0)
    reduced = _quantized(traced, summed, owned)
    result = traced.dequantize(
        _gathered(reduced.payload, rank, world, group, native),
        _gathered(reduced.scales, rank, world, group, native),
    )
    ok = torch.isfinite(result).all()
    if residual is not None and owned is not None:  # the eager sum's commit(ok)
        residual.copy_(torch.where(ok, mine.residual, residual))
        owned.copy_(torch.where(ok, reduced.residual, owned))
    exact = _exactly(coded.codec.fallback, group)  # run only where a rank flagged
    mean: torch.Tensor = torch.cond(ok, _used, exact, (result, flat))
    return mean, torch.stack([~ok, mine.flag | reduced.flag])


@dataclass
class GraphCodec:
    """One bucket a compiled step sums with its codec: the plan node, the codec and its
    traced quantization, the eager reducer's sum of the bucket (whose residuals the
    graph reads and updates), the bucket's elements, the group's size, this rank in it
    and whether it gathers natively (else by broadcasts: gloo), and the residual tensors
    the graph was last given."""

    node: str
    codec: TwoPhaseCodec
    traced: TracedBlocks
    eager: TwoPhaseSum
    numel: int
    world: int
    rank: int
    native: bool
    held: tuple[torch.Tensor, torch.Tensor] | None = None

    def residuals(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The residuals for the next replay: the eager sum's, at the addresses the graph
        was given before (an eager step in between replaced them: their values are
        copied into those); None without error feedback."""
        if not self.traced.error_feedback:
            return None
        padded = padded_numel(self.numel, self.world, self.traced.block)
        now = self.traced.residuals(self.eager, padded, self.world, device)
        held = self.held
        if held is None or held[0].shape != now[0].shape:
            self.held = now
            return now
        if now[0] is not held[0] or now[1] is not held[1]:
            with torch.no_grad():
                held[0].copy_(now[0])
                held[1].copy_(now[1])
            self.traced.hold(self.eager, *held)
        return held
