"""A text corpus every Python installation has: the standard library's own sources.

The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (third-party
``site-packages``/``dist-packages`` excluded), walked in sorted order, so every rank and
every run with the same Python version reads the same text. Files that cannot be read
or are not UTF-8 are skipped. Characters become token ids through a vocabulary built
from the corpus itself.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library (without installed packages)."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for directory, subdirs, files in os.walk(base):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        found.extend(Path(directory, f) for f in sorted(files) if f.endswith(".py"))
    return found


def read_corpus(max_bytes: int, root: str | Path | None = None) -> tuple[str, int]:
    """Concatenated sources up to about ``max_bytes`` of UTF-8; (text, files used)."""
    parts: list[str] = []
    total = used = 0
    for path in stdlib_sources(root):
        if total >= max_bytes:
            break
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if total + len(raw) > max_bytes:  # cut the last file to fit the cap
            text = raw[: max_bytes - total].decode("utf-8", errors="ignore")
        parts.append(text)
        total += len(text.encode("utf-8"))
        used += 1
    if not parts:
        where = root if root is not None else sysconfig.get_paths()["stdlib"]
        raise FileNotFoundError(f"no readable .py files under {where}; check the Python install")
    return "".join(parts), used


@dataclass(frozen=True)
class CharCorpus:
    """A character vocabulary and the corpus as token ids, split train/validation."""

    chars: str
    train: torch.Tensor
    val: torch.Tensor
    files: int

    @property
    def vocab_size(self) -> int:
        """Distinct characters in the corpus."""
        return len(self.chars)

    def decode(self, ids: torch.Tensor) -> str:
        """Token ids back to text."""
        return "".join(self.chars[i] for i in ids.tolist())


def load_char_corpus(
    max_mb: float, val_every: int = 10, root: str | Path | None = None
) -> CharCorpus:
    """Read the corpus, build its vocabulary (sorted by code point) and split it.

    The text is cut into ``val_every`` equal blocks per span and the last block of each
    span is validation (a 90/10 split for ``val_every=10``) so that both halves sample
    the whole corpus, not one end of the alphabet of module names.
    """
    text, files = read_corpus(int(max_mb * 2**20), root)
    # one int32 per character, via UTF-32, then ids by position in the sorted alphabet
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
    present = torch.bincount(codes) > 0
    alphabet = present.nonzero().flatten()
    ids = (torch.cumsum(present, 0) - 1)[codes.long()]
    chars = "".join(map(chr, alphabet.tolist()))
    block = max(1, min(16_384, len(ids) // (8 * val_every)))
    full = len(ids) // (block * val_every) * (block * val_every)
    grid = ids[:full].view(-1, val_every, block)
    train = torch.cat([grid[:, :-1].reshape(-1), ids[full:]])
    val = grid[:, -1].reshape(-1)
    return CharCorpus(chars, train, val, files)


def window_count(data: torch.Tensor, seq_len: int) -> int:
    """How many windows of ``seq_len`` tokens (plus the next one as target) ``data`` holds
    end to end."""
    return (len(data) - 1) // seq_len


def window_batch(
    data: torch.Tensor, indices: list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows number ``indices`` (window ``k`` starts at ``k * seq_len``) as inputs, and
    the same shifted by one as targets."""
    starts = torch.tensor(indices, dtype=torch.long) * seq_len
    tokens = data[starts[:, None] + torch.arange(seq_len + 1)]
    return tokens[:, :-1], tokens[:, 1:]


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len`` tokens (inputs) and the same shifted by one (targets)."""
    if len(data) <= seq_len + 1:
        raise ValueError(
            f"a split of {len(data)} tokens is too short for seq_len={seq_len}; "
            "raise --corpus-mb or lower --seq-len"
        )
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    window = starts[:, None] + torch.arange(seq_len + 1)
    tokens = data[window]
    return tokens[:, :-1], tokens[:, 1:]
