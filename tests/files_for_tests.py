"""File damage for the checkpoint tests (importable by both test modules)."""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path) -> None:
    """Invert every bit of the byte in the middle of ``path``."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
