"""File-system steps of a checkpoint: fsync, sha256, safe paths, step directory names."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from lamina.errors import ConfigError

#: A committed step directory and one still being written (or left by a crash).
STEP_DIR = re.compile(r"^step-(\d+)$")
INCOMPLETE_DIR = re.compile(r"^step-(\d+)\.incomplete$")
_CHUNK = 1 << 20


def step_dir(root: Path, step: int, complete: bool = True) -> Path:
    """``root/step-<step>`` (``.incomplete`` while it is written)."""
    return root / (f"step-{step}" if complete else f"step-{step}.incomplete")


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed directory under ``root``, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))


def incomplete_dirs(root: Path) -> list[Path]:
    """Directories of saves that never committed (a crash during the save)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if INCOMPLETE_DIR.match(p.name))


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (a rename or a new file in it) to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def inside(root: Path, name: str) -> Path:
    """``root/name`` when ``name`` is a plain file name in ``root`` (no ``..``, no
    separator, not a symlink leaving ``root``); else a ConfigError."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ConfigError(
            f"checkpoint {root}: manifest names the file {name!r}, which is not a plain file "
            "name inside the checkpoint; the manifest was tampered with, use another step"
        )
    path = root / name
    if path.is_symlink() and path.resolve().parent != root.resolve():
        raise ConfigError(
            f"checkpoint {root}: {name} is a symlink leading out of the checkpoint "
            f"({path.resolve()}); replace it with the file itself"
        )
    return path
