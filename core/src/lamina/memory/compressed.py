"""A unit's compressed gradient reduction, as the ZeRO-3 engine runs it.

The strategy gives a unit a :class:`GradientCodec` (built from a two-phase codec of
:mod:`lamina.comm.codecs`, which this layer does not import) for one of its gradient
collectives: the reduce-scatter over the shard group (``role="scatter"``, ZeRO-3) or the
all-reduce of the shard gradient across the replicas (``role="replicate"``, HSDP: the
collective that crosses the slow links). A codec's result is used when it is finite;
otherwise (a rank flagged the gradient: every rank of the group sees a non-finite result
in the same step) the collective is redone exactly, as ``codec.fallback`` says, and the
codec drops that step's residuals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

#: The collectives of a unit a codec can compress.
CODEC_ROLES = ("scatter", "replicate")


class GradientCodec(Protocol):
    """One unit's compressed gradient reduction, with its error-feedback state."""

    #: The codec's name (for the run log).
    name: str
    #: What a flagged step falls back to: "fp32" or "bf16".
    fallback: str

    def start_scatter(
        self, scatter_in: torch.Tensor, group: dist.ProcessGroup | None
    ) -> tuple[Any, Callable[[], torch.Tensor]]:
        """Start the reduce-scatter of ``scatter_in`` (rank-major slots): the work, and a
        function giving this rank's slot of the sum (not the mean)."""

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The sum of ``tensor`` over ``group`` (at least ``tensor.numel()`` elements)."""

    def commit(self, ok: bool) -> None:
        """Keep (``ok``) or drop the residuals of the last reduction."""

    def wire(self, role: str, numel: int, world: int) -> tuple[int, dict[str, int]]:
        """The ``role`` collective ("scatter" or "replicate") of ``numel`` elements over
        ``world`` ranks, for the trace: its size as its op counts it (an all_to_all its
        input, an all-reduce its buffer), and the bytes per dtype its calls hand to
        ``torch.distributed``."""

    def stats(self) -> dict[str, Any]:
        """What the last reduction saw on this rank (for the trace); ``"flagged"`` says
        why this rank flagged it ('' when it did not)."""


def usable(result: torch.Tensor) -> bool:
    """Whether a codec's result is finite (the same answer on every rank of the group)."""
    return bool(torch.isfinite(result).all())


def exact_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, wire: str) -> None:
    """Sum ``tensor`` over ``group`` in place, on the wire in ``wire`` ("fp32": the
    tensor's own dtype, or "bf16")."""
    if wire == "fp32":
        dist.all_reduce(tensor, group=group)
        return
    narrow = tensor.to(torch.bfloat16)
    dist.all_reduce(narrow, group=group)
    tensor.copy_(narrow)
