"""Crash-safe checkpoints: atomic, versioned, checksummed saves through
torch.distributed.checkpoint, and exact resume.

:class:`CheckpointManager` writes ``step-<n>.incomplete/`` (DCP shards, one writer per
rank, plus one small file per rank with its RNG states and extra data), fsyncs every
file, writes a manifest of their sizes and sha256 sums, and commits the step by one
atomic rename to ``step-<n>/``. A directory without that rename is never loaded.
:func:`seed_all` seeds every random stream a checkpoint records. See
``docs/checkpoints.md``.
"""

from lamina.checkpoint.manager import CheckpointManager
from lamina.checkpoint.manifest import MANIFEST, Manifest, read_manifest, verify_files
from lamina.checkpoint.rng import seed_all

__all__ = [
    "MANIFEST",
    "CheckpointManager",
    "Manifest",
    "read_manifest",
    "seed_all",
    "verify_files",
]
