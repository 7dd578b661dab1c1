"""Which keys each query block of context-parallel attention sees: :class:`Masking`.

Attention runs block by block: a chunk of this rank's queries against a chunk of keys
(:mod:`.layout`). A block is skipped when no query of it sees a key of it (a causal
block above the diagonal, two documents apart), runs without a mask when every query
sees every key, runs causal on the diagonal, and otherwise carries an additive mask
(packed documents). Every query sees itself, so each row has a key in some block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: What a block runs as: skipped, whole, causal on the diagonal, or with a mask.
SKIP, FULL, CAUSAL, MASKED = "skip", "full", "causal", "masked"


@dataclass(frozen=True)
class Block:
    """How the queries of chunk ``q`` attend to the keys of chunk ``k``."""

    kind: str
    #: The additive mask ``(batch, 1, chunk, chunk)`` (``MASKED`` only).
    mask: torch.Tensor | None = None

    @property
    def causal(self) -> bool:
        return self.kind == CAUSAL


@dataclass(frozen=True)
class Masking:
    """Causal or not, and the document of every global position (``(batch, length)``
    int64, None: one document per row)."""

    causal: bool
    documents: torch.Tensor | None = None

    def describe(self) -> str:
        """``causal``, ``causal, packed documents``, ``full``."""
        base = "causal" if self.causal else "full"
        return f"{base}, packed documents" if self.documents is not None else base

    def block(self, q: int, k: int, chunk: int, dtype: torch.dtype) -> Block:
        """How query chunk ``q`` sees key chunk ``k`` (chunks of ``chunk`` tokens)."""
        if self.causal and k > q:
            return Block(SKIP)
        diagonal = self.causal and k == q
        if self.documents is None:
            return Block(CAUSAL if diagonal else FULL)
        dq = self.documents[:, q * chunk : (q + 1) * chunk]
        dk = self.documents[:, k * chunk : (k + 1) * chunk]
        allowed = dq[:, :, None] == dk[:, None, :]
        if diagonal:
            allowed = (
                allowed & torch.ones(chunk, chunk, dtype=torch.bool, device=allowed.device).tril()
            )
        if not bool(allowed.any()):
            return Block(SKIP)
        if bool(allowed.all()):
            return Block(FULL)
        return Block(MASKED, additive_mask(allowed, dtype))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(batch, 1, q, k)``: 0 where allowed, a large finite negative elsewhere (a row
    with nothing allowed in this block gets a log-sum-exp far below any real one, so it
    weighs nothing when the blocks are merged)."""
    low = torch.finfo(dtype if dtype in (torch.float16,) else torch.float32).min / 2
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, low).unsqueeze(1)


def documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document ids from position ids that restart at each packed document (a new
    document wherever a position is not its predecessor's plus one), as transformers
    reads packed sequences; None when every row is one document."""
    ids = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
    first = ids[:, :1] - 1
    starts = torch.diff(ids, prepend=first, dim=-1) != 1
    documents = starts.long().cumsum(-1)
    if not bool(starts[:, 1:].any()):
        return None
    return documents
