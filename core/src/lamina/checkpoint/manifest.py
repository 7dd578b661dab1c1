"""The manifest of a committed checkpoint: what was saved, by whom, and each file's sum.

``manifest.json`` in a step directory records the format version, the step, the job
(world size, mesh, strategy, plan fingerprint, lamina and torch versions, time), the
model's tensors (name -> global shape and dtype: a checkpoint of another model is
refused before any tensor is read) and every other file of the directory with its size
and sha256. :func:`verify_files` checks those before DCP opens anything: its
``.metadata`` is a pickle, read only once its sum matches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lamina.checkpoint.files import inside, sha256_of
from lamina.errors import ConfigError

MANIFEST = "manifest.json"
FORMAT = "lamina-checkpoint"
VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    """One file of the checkpoint: size in bytes and sha256."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` holds (see the module docstring)."""

    step: int
    world_size: int
    strategy: str
    plan_fingerprint: str
    mesh: tuple[str, ...]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    files: dict[str, FileEntry]
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        """The manifest as plain data."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "plan_fingerprint": self.plan_fingerprint,
            "mesh": list(self.mesh),
            "tensors": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.tensors.items()},
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
            "versions": self.versions,
            "created": self.created,
        }

    @property
    def total_bytes(self) -> int:
        """Bytes of every file the manifest lists."""
        return sum(f.bytes for f in self.files.values())


def _fail(path: Path, what: str) -> ConfigError:
    return ConfigError(
        f"checkpoint manifest {path}: {what}; this step was not written by lamina's "
        "CheckpointManager or was modified: resume from another step"
    )


def read_manifest(directory: Path) -> Manifest:
    """The manifest of the step ``directory`` (ConfigError naming the file and field)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ConfigError(
            f"checkpoint {directory} has no {MANIFEST}: it was never committed; "
            "delete it (the next save removes it) and resume from another step"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"not readable JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(path, f"'format' is not {FORMAT!r}")
    if data.get("version") != VERSION:
        raise ConfigError(
            f"checkpoint manifest {path}: version {data.get('version')!r}, this lamina reads "
            f"version {VERSION}; load it with the lamina that wrote it"
        )
    try:
        tensors = {
            str(k): (tuple(int(n) for n in v["shape"]), str(v["dtype"]))
            for k, v in data["tensors"].items()
        }
        files = {
            str(k): FileEntry(int(v["bytes"]), str(v["sha256"])) for k, v in data["files"].items()
        }
        return Manifest(
            step=int(data["step"]),
            world_size=int(data["world_size"]),
            strategy=str(data["strategy"]),
            plan_fingerprint=str(data["plan_fingerprint"]),
            mesh=tuple(str(line) for line in data["mesh"]),
            tensors=tensors,
            files=files,
            versions={str(k): str(v) for k, v in data.get("versions", {}).items()},
            created=str(data.get("created", "")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _fail(path, f"field missing or malformed ({type(exc).__name__}: {exc})") from None


def verify_files(directory: Path, manifest: Manifest, names: Sequence[str] | None = None) -> None:
    """Check ``names`` (default: every file the manifest lists) against their recorded
    size and sha256, and that nothing else lies in the directory; ConfigError naming the
    first file that differs and the fix."""
    listed = set(manifest.files)
    extra = sorted(p.name for p in directory.iterdir() if p.name not in listed | {MANIFEST})
    if extra and names is None:
        raise ConfigError(
            f"checkpoint {directory}: {extra[0]} is not in the manifest (written after the "
            "commit?); remove it or resume from another step"
        )
    for name in sorted(listed) if names is None else names:
        entry = manifest.files[name]
        path = inside(directory, name)
        if not path.is_file():
            raise ConfigError(
                f"checkpoint {directory}: {name} is missing (the manifest lists it); restore "
                "it or resume from another step"
            )
        size = path.stat().st_size
        if size != entry.bytes:
            raise ConfigError(
                f"checkpoint {directory}: {name} has {size} bytes, the manifest says "
                f"{entry.bytes} (truncated or replaced); restore it or resume from another step"
            )
        if sha256_of(path) != entry.sha256:
            raise ConfigError(
                f"checkpoint {directory}: {name} does not match its sha256 in the manifest "
                "(corrupted); restore it or resume from another step"
            )


def first_model_difference(
    manifest: Manifest, tensors: Mapping[str, tuple[tuple[int, ...], str]], directory: Path
) -> str:
    """'' when the model ``tensors`` (name -> shape, dtype) are the checkpoint's, else a
    one-line error naming the first difference."""
    saved = manifest.tensors
    fix = "point the manager at this model's checkpoints"
    for name in sorted(set(saved) | set(tensors)):
        if name not in tensors:
            return f"checkpoint {directory} holds tensor {name!r}, which this model lacks; {fix}"
        if name not in saved:
            return f"checkpoint {directory} has no tensor {name!r} of this model; {fix}"
        if saved[name] != tensors[name]:
            (s_shape, s_dtype), (shape, dtype) = saved[name], tensors[name]
            return (
                f"checkpoint {directory}: tensor {name!r} is {list(s_shape)} {s_dtype} there "
                f"and {list(shape)} {dtype} here; {fix}"
            )
    return ""
