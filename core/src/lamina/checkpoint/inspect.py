"""Offline views of checkpoints (no process group, one machine): the ``lamina
checkpoint`` commands' logic.

:func:`list_steps` describes every step directory under a checkpoint root,
:func:`resolve_step` picks one committed step (from a root or a step directory),
:func:`verify_step` checks its manifest and every file, :func:`load_flat` reads every
tensor and value of a verified step in full (shards joined; flattened names),
:func:`diff_states` compares two such loads and :func:`export_model` writes the model's
tensors to a ``.safetensors`` file. Every bad input is a one-line ``ConfigError`` naming
the thing and the fix. DCP's ``.metadata`` is a pickle: it is only read once
:func:`verify_step` has checked its sha256 against the manifest.
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lamina.checkpoint.files import INCOMPLETE_DIR, STEP_DIR, committed_steps, step_dir
from lamina.checkpoint.legacy import WRAPPER
from lamina.checkpoint.manifest import MANIFEST, Manifest, read_manifest, verify_files
from lamina.errors import ConfigError

INCOMPLETE = "incomplete (never committed)"
COMPLETE = "complete"
#: The prefixes of the DCP state :class:`CheckpointManager` saves.
MODEL_PREFIX = "model."
#: Flattened names of the per-rank files' entries: ``rank-<r>.<key>...``.
RANK_FILE = "rank-{}.pt"


# -- listing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepInfo:
    """One step directory: its state (``complete``, ``incomplete (never committed)`` or
    ``bad manifest: <reason>``), what the manifest says, its bytes on disk and when it was
    written."""

    step: int
    path: Path
    state: str
    world_size: int | None
    strategy: str | None
    total_bytes: int
    written: datetime.datetime
    #: The mesh it was saved on, ``fsdp=2 x tp=2`` (empty: not recorded).
    layout: str = ""


def mesh_layout(mesh_lines: Sequence[str]) -> str:
    """``fsdp=2 x tp=2`` from a manifest's mesh lines (``axes=[...]``, ``shape=[...]``);
    empty when they do not say."""
    facts = dict(line.split("=", 1) for line in mesh_lines if "=" in line)
    try:
        axes = ast.literal_eval(facts.get("axes", "[]"))
        shape = ast.literal_eval(facts.get("shape", "[]"))
    except (ValueError, SyntaxError):
        return ""
    if len(axes) != len(shape):
        return ""
    return " x ".join(f"{a}={n}" for a, n in zip(axes, shape, strict=True))


def _require_root(root: Path) -> None:
    if not root.exists():
        raise ConfigError(
            f"checkpoint directory {root} does not exist; pass the directory given to "
            "CheckpointManager (it holds step-<n>/ directories)"
        )
    if not root.is_dir():
        raise ConfigError(f"checkpoint directory {root} is a file; pass a directory")


def _disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def _mtime(path: Path) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)


def _created(manifest: Manifest, directory: Path) -> datetime.datetime:
    try:
        when = datetime.datetime.fromisoformat(manifest.created)
    except ValueError:
        return _mtime(directory)
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.timezone.utc)


def _reason(exc: ConfigError, directory: Path) -> str:
    """The short part of a read_manifest error: what is wrong with the manifest."""
    text = str(exc)
    prefix = f"checkpoint manifest {directory / MANIFEST}: "
    if text.startswith(prefix):
        return text[len(prefix) :].split("; this step was not written", 1)[0]
    if not (directory / MANIFEST).is_file():
        return f"no {MANIFEST}"
    return text


def describe(directory: Path) -> StepInfo:
    """What :func:`list_steps` says about one ``step-<n>[.incomplete]`` directory."""
    match = STEP_DIR.match(directory.name) or INCOMPLETE_DIR.match(directory.name)
    if match is None:
        raise ConfigError(f"{directory} is not a step-<n> directory of a checkpoint")
    step = int(match.group(1))
    size = _disk_bytes(directory)
    if INCOMPLETE_DIR.match(directory.name):
        return StepInfo(step, directory, INCOMPLETE, None, None, size, _mtime(directory))
    try:
        manifest = read_manifest(directory)
    except ConfigError as exc:
        state = f"bad manifest: {_reason(exc, directory)}"
        return StepInfo(step, directory, state, None, None, size, _mtime(directory))
    if manifest.step != step:
        state = f"bad manifest: it says step {manifest.step}"
        return StepInfo(step, directory, state, None, None, size, _mtime(directory))
    return StepInfo(
        step,
        directory,
        COMPLETE,
        manifest.world_size,
        manifest.strategy,
        size,
        _created(manifest, directory),
        mesh_layout(manifest.mesh),
    )


def list_steps(root: Path) -> list[StepInfo]:
    """Every step directory under ``root`` (committed and ``.incomplete``), by step."""
    _require_root(root)
    found = [
        describe(p)
        for p in root.iterdir()
        if p.is_dir() and (STEP_DIR.match(p.name) or INCOMPLETE_DIR.match(p.name))
    ]
    return sorted(found, key=lambda s: (s.step, s.state == INCOMPLETE))


def format_age(then: datetime.datetime, now: datetime.datetime | None = None) -> str:
    """``just now``, ``42 s ago``, ``3 min ago``, ``5 h ago``, ``2 days ago`` (or ``in the
    future`` for a clock ahead of this one)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    seconds = (now - then).total_seconds()
    if seconds < -60:
        return "in the future"
    if seconds < 5:
        return "just now"
    if seconds < 60:
        return f"{int(seconds)} s ago"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400 * 2:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} days ago"


# -- picking and verifying a step ------------------------------------------------------------
def resolve_step(path: Path, step: int | None = None) -> Path:
    """The committed step directory ``path`` names: ``path`` itself when it is a step
    directory (``step``, when given, must be its step), else ``path/step-<step>`` (default:
    the latest committed step under ``path``)."""
    _require_root(path)
    if INCOMPLETE_DIR.match(path.name):
        raise ConfigError(
            f"{path} is a save that never committed (it is never loaded); pass a committed "
            "step-<n> directory or the checkpoint root"
        )
    own = STEP_DIR.match(path.name)
    if own is not None or (path / MANIFEST).is_file():
        if step is not None and own is not None and int(own.group(1)) != step:
            raise ConfigError(
                f"{path} is step {own.group(1)}, not --step {step}; pass the checkpoint root "
                f"({path.parent}) to pick a step, or drop --step"
            )
        return path
    steps = committed_steps(path)
    if not steps:
        raise ConfigError(
            f"checkpoint directory {path} has no committed step (no step-<n>/ directory); "
            "pass the directory a CheckpointManager saved into"
        )
    if step is None:
        return step_dir(path, steps[-1])
    if step not in steps:
        raise ConfigError(
            f"checkpoint directory {path} has no committed step {step}; its steps are "
            f"{', '.join(map(str, steps))} (see `lamina checkpoint ls {path}`)"
        )
    return step_dir(path, step)


def verify_step(directory: Path) -> Manifest:
    """The manifest of the committed step ``directory`` once every file it lists has its
    recorded size and sha256 and nothing else lies there (ConfigError naming the file)."""
    manifest = read_manifest(directory)
    match = STEP_DIR.match(directory.name)
    if match is not None and int(match.group(1)) != manifest.step:
        raise ConfigError(
            f"checkpoint manifest {directory / MANIFEST} says step {manifest.step}, the "
            "directory is another step (renamed?); restore the directory's name"
        )
    verify_files(directory, manifest)
    return manifest


# -- loading ---------------------------------------------------------------------------------
def _element(nested: Mapping[str, Any], path: Iterable[Any]) -> Any:
    value: Any = nested
    for part in path:
        value = value[part]
    return value


def _load_dcp(directory: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Every DCP entry (flattened name -> full tensor or value) of a verified step."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
        nested: dict[str, Any] = {}
        _load_state_dict(
            nested,
            storage_reader=FileSystemReader(str(directory)),
            planner=_EmptyStateDictLoadPlanner(keys=keys),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
        flat = {}
        for name in metadata.state_dict_metadata:
            path = (metadata.planner_data or {}).get(name, (name,))
            if keys is None or path[0] in keys:
                flat[name] = _element(nested, path)
        return flat
    except Exception as exc:  # DCP raises many kinds (CheckpointException, OSError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"checkpoint {directory}: torch.distributed.checkpoint could not read it "
            f"({type(exc).__name__}: {first[:200]}) although its files match the manifest; "
            "read it with the torch version that wrote it"
        ) from None


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    else:
        out[prefix] = value


def load_flat(directory: Path, manifest: Manifest) -> dict[str, Any]:
    """Every entry of the verified step ``directory``: the DCP state (``model.<param>``,
    ``optim.state.<param>.<key>``, ``optim.param_groups.<i>.<key>``, tensors joined from
    their shards) and each rank file's entries (``rank-<r>.rng.torch``,
    ``rank-<r>.extra.<key>``, ...)."""
    flat = _load_dcp(directory)
    for rank in range(manifest.world_size):
        name = RANK_FILE.format(rank)
        if name not in manifest.files:
            continue
        try:
            payload = torch.load(directory / name, weights_only=True)
        except Exception as exc:
            raise ConfigError(
                f"checkpoint {directory}: {name} is not a lamina rank file ({exc}); resume "
                "from another step"
            ) from None
        _flatten(name.removesuffix(".pt"), payload, flat)
    return flat


# -- diff ------------------------------------------------------------------------------------


def unwrap_names(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` with the ``module.`` of a wrapper (lamina's dp before it extended models in
    place, torch DDP) dropped from the parameter names (``model.module.<p>`` ->
    ``model.<p>``, ``optim.state.module.<p>...`` -> ``optim.state.<p>...`` and in
    ``optim.param_groups.<i>.params``) when every model entry has it, so that such a
    checkpoint compares with one of the model itself; else ``flat``."""
    model = [n for n in flat if n.startswith(MODEL_PREFIX)]
    if not model or not all(n.startswith(MODEL_PREFIX + WRAPPER) for n in model):
        return dict(flat)
    out: dict[str, Any] = {}
    for name, value in flat.items():
        for prefix in (MODEL_PREFIX, "optim.state."):
            if name.startswith(prefix + WRAPPER):
                name = prefix + name[len(prefix + WRAPPER) :]
        params = name.startswith("optim.param_groups.") and name.endswith(".params")
        if params and isinstance(value, list):
            value = [v.removeprefix(WRAPPER) if isinstance(v, str) else v for v in value]
        out[name] = value
    return out


@dataclass(frozen=True)
class DiffRow:
    """One entry of a diff: ``status`` is ``equal``, ``differs``, ``only in A``, ``only in
    B``, ``shape differs``, ``dtype differs`` or ``type differs``; ``max_abs`` is the max
    abs difference of two tensors of one shape and dtype; ``detail`` says what differs."""

    name: str
    is_tensor: bool
    status: str
    max_abs: float | None = None
    detail: str = ""

    @property
    def equal(self) -> bool:
        return self.status == "equal"


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() and flat.element_size() > 1 else flat


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (a NaN equals the same NaN; 0.0 and -0.0 differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return torch.equal(_bits(a), _bits(b))
    except RuntimeError:  # a dtype that cannot be viewed as bytes
        return torch.equal(a, b)


def max_abs_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference of two tensors of one shape (0.0 when empty; nan where one holds
    a NaN the other does not)."""
    if a.numel() == 0:
        return 0.0
    if a.is_complex():
        diff = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    else:
        diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
    same_nan = torch.isnan(a) & torch.isnan(b) if a.is_floating_point() else None
    if same_nan is not None:
        diff = torch.where(same_nan, torch.zeros_like(diff), diff)
    if torch.isnan(diff).any():
        return math.nan
    return float(diff.max())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bitwise_equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def diff_states(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[DiffRow]:
    """One row per name in ``a`` or ``b``, by name."""
    rows = []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            rows.append(DiffRow(name, isinstance(a[name], torch.Tensor), "only in A"))
            continue
        if name not in a:
            rows.append(DiffRow(name, isinstance(b[name], torch.Tensor), "only in B"))
            continue
        x, y = a[name], b[name]
        x_tensor, y_tensor = isinstance(x, torch.Tensor), isinstance(y, torch.Tensor)
        if x_tensor != y_tensor:
            detail = f"{type(x).__name__} vs {type(y).__name__}"
            rows.append(DiffRow(name, True, "type differs", detail=detail))
        elif not x_tensor:
            same = _same(x, y)
            detail = "" if same else f"{_short(x)} vs {_short(y)}"
            rows.append(DiffRow(name, False, "equal" if same else "differs", detail=detail))
        elif x.shape != y.shape:
            rows.append(DiffRow(name, True, "shape differs", detail=f"{_shape(x)} vs {_shape(y)}"))
        elif x.dtype != y.dtype:
            rows.append(DiffRow(name, True, "dtype differs", detail=f"{_shape(x)} vs {_shape(y)}"))
        elif bitwise_equal(x, y):
            rows.append(DiffRow(name, True, "equal", max_abs=0.0))
        else:
            rows.append(DiffRow(name, True, "differs", max_abs=max_abs_difference(x, y)))
    return rows


# -- export ----------------------------------------------------------------------------------
def model_state(flat: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's tensors under their original parameter names (``model.`` removed, and
    ``module.`` when every name has it: a checkpoint of a wrapped model, such as lamina's
    dp wrote before it extended models in place), and the names of the model's
    non-tensor entries (skipped)."""
    tensors: dict[str, torch.Tensor] = {}
    skipped = []
    for name, value in flat.items():
        if not name.startswith(MODEL_PREFIX):
            continue
        if isinstance(value, torch.Tensor):
            tensors[name[len(MODEL_PREFIX) :]] = value
        else:
            skipped.append(name[len(MODEL_PREFIX) :])
    if tensors and all(n.startswith(WRAPPER) for n in tensors):
        tensors = {n[len(WRAPPER) :]: t for n, t in tensors.items()}
    return tensors, skipped


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr()) if t.numel() else id(t)


def safetensors_ready(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous, dense CPU tensors, none sharing memory with another (safetensors refuses
    shared tensors: the later ones of a tied group are cloned)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        key = _storage_key(t)
        if key in seen:
            t = t.clone()
            key = _storage_key(t)
        seen.add(key)
        out[name] = t
    return out


def export_model(directory: Path, manifest: Manifest, out: Path) -> tuple[int, list[str]]:
    """Write the verified step's full model state to ``out`` (safetensors); (tensor count,
    skipped non-tensor names)."""
    if importlib.util.find_spec("safetensors") is None:
        raise ConfigError(
            "exporting needs the safetensors package, which is not installed; "
            "pip install 'lamina-core[export]'"
        )
    from safetensors.torch import save_file

    if not out.parent.is_dir():
        raise ConfigError(f"output {out}: directory {out.parent} does not exist; create it")
    if out.is_dir():
        raise ConfigError(f"output {out} is a directory; pass a file name (model.safetensors)")
    tensors, skipped = model_state(_load_dcp(directory, keys={"model"}))
    if not tensors:
        raise ConfigError(
            f"checkpoint {directory} holds no model tensors (no 'model.' entries); it was not "
            "written by lamina's CheckpointManager"
        )
    metadata = {
        "format": "pt",
        "lamina.step": str(manifest.step),
        "lamina.strategy": manifest.strategy,
        "lamina.world_size": str(manifest.world_size),
    }
    partial = out.with_name(out.name + ".partial")
    try:
        save_file(safetensors_ready(tensors), str(partial), metadata=metadata)
        partial.replace(out)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"output {out}: cannot write it ({exc.strerror or exc})") from None
    return len(tensors), skipped


__all__ = [
    "COMPLETE",
    "INCOMPLETE",
    "DiffRow",
    "StepInfo",
    "bitwise_equal",
    "describe",
    "diff_states",
    "export_model",
    "format_age",
    "list_steps",
    "load_flat",
    "max_abs_difference",
    "model_state",
    "resolve_step",
    "safetensors_ready",
    "unwrap_names",
    "verify_step",
]
