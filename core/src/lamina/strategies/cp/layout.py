"""Which tokens of the global sequence each context-parallel rank holds: :class:`SequenceLayout`.

The sequence is cut into equal chunks. Without load balancing rank ``r`` of ``cp`` holds
chunk ``r`` of ``cp``; with it (the default, for causal attention) the sequence is cut in
``2 * cp`` chunks and rank ``r`` holds the head chunk ``r`` and the tail chunk
``2 * cp - 1 - r``, so that every rank's queries see as many earlier keys as the
others' (the causal work is even). Torch-only arithmetic, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.errors import ConfigError


@dataclass(frozen=True)
class SequenceLayout:
    """``length`` tokens over ``size`` ranks; this rank is ``index``."""

    length: int
    size: int
    index: int
    balanced: bool = True

    def __post_init__(self) -> None:
        parts = self.chunks_total
        if self.length % parts:
            raise ConfigError(
                f"context parallelism: a sequence of {self.length} tokens does not split into "
                f"{parts} equal chunks (cp={self.size}"
                f"{', load-balanced: 2 chunks per rank' if self.balanced else ''}); pad the "
                f"sequence to a multiple of {parts}"
            )

    @property
    def chunks_total(self) -> int:
        """How many chunks the sequence is cut into."""
        return 2 * self.size if self.balanced else self.size

    @property
    def chunk(self) -> int:
        """Tokens per chunk."""
        return self.length // self.chunks_total

    @property
    def local_length(self) -> int:
        """Tokens this rank holds."""
        return self.length // self.size

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunk indices rank ``rank`` of the group holds, in its local order."""
        if self.balanced:
            return (rank, 2 * self.size - 1 - rank)
        return (rank,)

    @property
    def local_chunks(self) -> tuple[int, ...]:
        """This rank's chunks, in local order."""
        return self.chunks_of(self.index)

    def positions_of(self, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of rank ``rank``'s tokens, in its local order (int64)."""
        c = self.chunk
        return torch.cat(
            [torch.arange(k * c, (k + 1) * c, device=device) for k in self.chunks_of(rank)]
        )

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens, in local order (int64)."""
        return self.positions_of(self.index, device)

    def gathered_order(self, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of an all-gather's output (rank 0's tokens, then rank 1's ...)."""
        return torch.cat([self.positions_of(r, device) for r in range(self.size)])

    def to_global(self, device: torch.device | None = None) -> torch.Tensor:
        """Indices putting a gathered tensor (in :meth:`gathered_order`) into global order."""
        return torch.argsort(self.gathered_order(device))

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of a global ``tensor`` cut on ``dim``."""
        return tensor.index_select(dim, self.positions(tensor.device))


def extra_blocks(layout: SequenceLayout, causal: bool) -> float:
    """Whole blocks one call computes on a rank beyond those among its own chunks (a
    diagonal block counts half): what cp adds to the local step's attention."""
    own = len(layout.local_chunks)
    if not causal:
        return float(layout.chunks_total * own - own * own)
    seen = 0.0
    for q in layout.local_chunks:
        seen += q + 0.5  # the chunks before it, and half the diagonal
    held = sum(
        0.5 if a == b else 1.0 for a in layout.local_chunks for b in layout.local_chunks if b <= a
    )
    return seen - held
