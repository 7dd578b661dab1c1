"""``CheckpointManager``: atomic, versioned, checksummed saves and exact resume.

A save of step ``n`` (every rank calls it, as it does the training step):

1. rank 0 removes what crashed saves left (``step-*.incomplete/``) and creates
   ``step-<n>.incomplete/``;
2. the model's and optimizer's state dicts (``torch.distributed.checkpoint.state_dict``:
   original parameter names, sharded under ZeRO-3 / HSDP) go through ``dcp.save``, one
   writer per rank; each rank writes ``rank-<r>.pt`` (its RNG states, the scheduler, the
   caller's ``extra`` such as a data position) and fsyncs its files, sums them (sha256)
   and sends the sums to rank 0;
3. rank 0 writes ``manifest.json`` (:mod:`lamina.checkpoint.manifest`), fsyncs it and
   the directory, renames the directory to ``step-<n>/`` (the commit) and fsyncs the
   parent; then it removes committed steps beyond ``keep``;
4. a barrier: no rank goes on before the commit.

With ``async_save=True`` steps 2-4 run on a background thread after the state is copied
(the training goes on meanwhile, ahead of the writer thread, which runs at the lowest CPU
priority); their collectives use a gloo group of their own, and
the next save (or :meth:`CheckpointManager.wait` / ``close``) waits for the commit, at
most ``async_timeout_s``.

``load_latest`` takes the newest committed step, checks the manifest, the model's tensor
names and shapes and every file's size and sha256 (the files split across the ranks)
before any tensor is read, then loads through DCP (which reshards to this job's world
size; a checkpoint whose names carry the ``module.`` of the wrapper ``dp`` used before it
extended models in place loads with the names mapped, :mod:`lamina.checkpoint.legacy`),
restores the scheduler, and on the same world size every rank's RNG states;
:attr:`CheckpointManager.extra` is then this rank's ``extra`` (a rank beyond the saved
world size gets rank 0's: what a data position equal on every rank, such as
:class:`lamina.data.EpochSampler`'s state, needs), :attr:`CheckpointManager.resumed_from`
the step directory, and rank 0 prints ``lamina checkpoint: resumed from <dir>/step-<n>``.
A killed save leaves only an ``.incomplete`` directory, which is never loaded.

Crash tests kill a rank during a save with ``$LAMINA_CHECKPOINT_KILL=POINT:RANK[:STEP]``
(``POINT`` is ``after-shards`` or ``before-commit``; ``STEP``: only in that step's save,
else the first): that rank SIGKILLs itself once at that point (a marker file in the
directory keeps a restarted job from dying again).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import datetime
import json
import os
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from lamina.checkpoint import legacy, rng
from lamina.checkpoint.files import (
    committed_steps,
    fsync_dir,
    fsync_file,
    incomplete_dirs,
    sha256_of,
    step_dir,
)
from lamina.checkpoint.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    first_model_difference,
    read_manifest,
    verify_files,
)
from lamina.errors import ConfigError, LaminaError

KILL_ENV = "LAMINA_CHECKPOINT_KILL"
KILL_POINTS = ("after-shards", "before-commit")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """``get_state_dict``'s model and optimizer state; a model whose parameters are split
    (tensor parallelism) gives its optimizer state as whole-tensor DTensors too, as its
    parameters are (``optimizer_state_to_global``), so a resume on another layout cuts
    every piece right. A model may name the ``StateDictOptions`` its checkpoints use
    (``checkpoint_state_options``: a pipeline stage keys its optimizer's groups by
    parameter name, since the stages' groups differ)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    to_global = getattr(model, "optimizer_state_to_global", None)
    if to_global is not None:
        optim_state = to_global(optim_state)
    return model_state, optim_state


def _options(model: torch.nn.Module) -> StateDictOptions | None:
    options = getattr(model, "checkpoint_state_options", None)
    return options if isinstance(options, StateDictOptions) else None


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def _gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    _, world = _rank_world()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


@dataclass
class _SaveJob:
    """What the finishing half of a save needs (it may run on the background thread)."""

    step: int
    rank: int
    world: int
    work: Path
    final: Path
    state: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    plan: Any


def _staged(state: Any) -> Any:
    """A copy of ``state`` that later training steps cannot change: plain tensors on the
    host, a DTensor's local shard cloned where it lives."""
    if isinstance(state, dict):
        return {k: _staged(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_staged(v) for v in state]
    if isinstance(state, DTensor):
        return state.detach().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return copy.deepcopy(state)


def tensor_specs(state: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (global shape, dtype) of the tensors of a model state dict."""
    out = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            out[name] = (tuple(value.shape), str(value.dtype).removeprefix("torch."))
    return out


def job_tensor_specs(state: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The model's tensors over every rank (collective): a pipeline stage holds only its
    part of the model, and the checkpoint holds them all."""
    merged: dict[str, tuple[tuple[int, ...], str]] = {}
    for specs in _gather(tensor_specs(state)):
        merged.update(specs)
    return dict(sorted(merged.items()))


class CheckpointManager:
    """Saves and resumes a training job under ``directory`` (see the module docstring).

    ``keep`` committed steps are kept (the oldest removed after each save). Every rank of
    the job creates the manager and calls :meth:`save` and :meth:`load_latest` together.
    ``async_save=True`` copies the state (to host memory for plain tensors; a sharded
    ``DTensor``'s local shard is cloned where it lives) and writes and commits it on a
    background thread over a gloo group of its own; the next save, :meth:`wait` or
    :meth:`close` waits for it, at most ``async_timeout_s`` seconds.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 3,
        async_save: bool = False,
        async_timeout_s: float = 600.0,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"CheckpointManager keep={keep!r}: keep at least 1 checkpoint")
        if not async_timeout_s > 0:
            raise ConfigError(f"async_timeout_s={async_timeout_s!r}: give a positive number")
        self.root = Path(directory)
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(
                f"checkpoint directory {self.root} is a file; pass a directory (it is created)"
            )
        self.keep = keep
        self.extra: dict[str, Any] | None = None
        self.loaded: Manifest | None = None
        #: The step directory :meth:`load_latest` resumed from (None: nothing resumed).
        self.resumed_from: Path | None = None
        self.async_save = bool(async_save)
        self.async_timeout_s = float(async_timeout_s)
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[int, concurrent.futures.Future[None]] | None = None
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="lamina-checkpoint", initializer=_yield_to_training
            )
            if self.async_save
            else None
        )

    # -- queries -----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return committed_steps(self.root)

    # -- saving ------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write and commit step ``step`` (every rank calls it); returns the directory the
        step has once committed. With ``async_save`` the commit happens on a background
        thread: :meth:`wait` (or the next save) waits for it."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"checkpoint step must be an int >= 0, got {step!r}")
        self.wait()
        rank, world = _rank_world()
        final, work = step_dir(self.root, step), step_dir(self.root, step, complete=False)
        if final.is_dir():  # committed before (a resumed job reaching it again): keep it
            _barrier()
            return final
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in incomplete_dirs(self.root):
                shutil.rmtree(stale)
            work.mkdir()
        _barrier()
        if not work.is_dir():
            raise ConfigError(
                f"checkpoint directory {self.root} is not the one rank 0 writes to (rank "
                f"{rank} cannot see {work.name}): give every rank the same path on a file "
                "system they all share"
            )
        model_state, optim_state = _state_dicts(model, optimizer)
        payload = {
            "rng": rng.capture(*_device()),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra": extra,
        }
        torch.save(payload, work / f"rank-{rank}.pt")
        job = _SaveJob(
            step=step,
            rank=rank,
            world=world,
            work=work,
            final=final,
            state={"model": model_state, "optim": optim_state},
            tensors=job_tensor_specs(model_state),
            plan=getattr(model, "execution_plan", None),
        )
        if not self.async_save:
            self._finish(job, None)
            return final
        job.state = _staged(job.state)  # the next steps change the live tensors
        group = self._async_group()
        assert self._worker is not None
        self._pending = (step, self._worker.submit(self._finish, job, group))
        return final

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the background save (``async_save``), at most ``timeout`` seconds
        (default: the manager's ``async_timeout_s``); re-raises its error."""
        if self._pending is None:
            return
        step, future = self._pending
        limit = self.async_timeout_s if timeout is None else timeout
        try:
            future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            raise LaminaError(
                f"the background save of step {step} did not finish in {limit:.0f} s; the "
                f"storage under {self.root} is slow or a rank died: raise async_timeout_s "
                "or look at the other ranks' logs"
            ) from None
        finally:
            if future.done():
                self._pending = None

    def close(self) -> None:
        """Wait for a background save and stop the worker thread."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None

    def _async_group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own for the background saves (their collectives must not
        interleave with the training's on the default group); created on first use, by
        every rank at the same save."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _finish(self, job: _SaveJob, group: dist.ProcessGroup | None) -> None:
        """Write the shards, fsync and sum this rank's files, commit on rank 0."""
        work, rank = job.work, job.rank
        dcp_save(job.state, checkpoint_id=str(work), process_group=group)
        _maybe_die("after-shards", rank, job.step, self.root)
        mine = sorted(p for p in work.iterdir() if p.name.startswith(f"__{rank}_"))
        mine.append(work / f"rank-{rank}.pt")
        if rank == 0:
            mine += [p for p in work.iterdir() if p.name == ".metadata"]
        entries = {}
        for path in mine:
            fsync_file(path)
            entries[path.name] = (path.stat().st_size, sha256_of(path))
        gathered = _gather(entries, group)
        if rank == 0:
            files = {n: FileEntry(*v) for part in gathered for n, v in part.items()}
            self._commit(job, files)
        _barrier(group)

    def _commit(self, job: _SaveJob, files: dict[str, FileEntry]) -> None:
        work, final = job.work, job.final
        stray = sorted(p.name for p in work.iterdir() if p.name not in files)
        if stray:
            raise ConfigError(
                f"checkpoint {work}: {stray[0]} was written by no rank's save (another job "
                "writing to the same directory?); give each job its own directory"
            )
        runtime = _runtime()
        manifest = Manifest(
            step=job.step,
            world_size=job.world,
            strategy=str(getattr(job.plan, "strategy", "none")),
            plan_fingerprint=str(getattr(job.plan, "fingerprint", "")),
            mesh=tuple(runtime.mesh.lines()) if runtime is not None else (),
            tensors=job.tensors,
            files=files,
            versions={"torch": torch.__version__, "lamina": _lamina_version()},
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )
        path = work / MANIFEST
        path.write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n")
        fsync_file(path)
        fsync_dir(work)
        _maybe_die("before-commit", 0, job.step, self.root)
        os.rename(work, final)
        fsync_dir(self.root)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(step_dir(self.root, old))
        fsync_dir(self.root)

    # -- loading -----------------------------------------------------------------------------
    def load_latest(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
    ) -> int | None:
        """Resume from the newest committed step: its step number, or None (nothing to
        resume: the job starts fresh). Every rank calls it."""
        rank, world = _rank_world()
        steps = self.steps()
        if rank == 0:
            for stale in incomplete_dirs(self.root):
                print(
                    f"lamina checkpoint: ignoring {stale} (a save that never committed; the "
                    "next save removes it)",
                    flush=True,
                )
            if not steps:
                print(f"lamina checkpoint: no committed step in {self.root}: starting fresh")
        if not steps:
            return None
        directory = step_dir(self.root, steps[-1])
        manifest = read_manifest(directory)
        model_state, optim_state = _state_dicts(model, optimizer)
        specs = job_tensor_specs(model_state)
        prefix = legacy.wrapper_prefix(manifest.tensors, specs)
        own_names = dataclasses.replace(manifest, tensors=legacy.strip(manifest.tensors, prefix))
        difference = first_model_difference(own_names, specs, directory)
        if difference:
            raise ConfigError(difference)
        names = sorted(manifest.files)
        try:
            verify_files(directory, manifest, names[rank::world])
            if rank == 0:
                verify_files(directory, manifest, [])  # nothing outside the manifest
            problem = ""
        except ConfigError as exc:
            problem = str(exc)
        problems = [p for p in _gather(problem) if p]
        if problems:
            raise ConfigError(problems[0])
        saved = legacy.as_saved({"model": model_state, "optim": optim_state}, prefix)
        dcp_load(saved, checkpoint_id=str(directory))
        loaded = legacy.as_model(saved, prefix)
        to_local = getattr(model, "optimizer_state_to_local", None)
        optim_loaded = to_local(loaded["optim"]) if to_local is not None else loaded["optim"]
        set_state_dict(
            model,
            optimizer,
            model_state_dict=loaded["model"],
            optim_state_dict=optim_loaded,
            options=_options(model),
        )
        same_world = manifest.world_size == world
        own = directory / f"rank-{rank if rank < manifest.world_size else 0}.pt"
        payload = torch.load(own, weights_only=True)
        if scheduler is not None and payload.get("scheduler") is not None:
            scheduler.load_state_dict(payload["scheduler"])
        if same_world:
            rng.restore(payload["rng"], *_device())
        self.extra = payload.get("extra")
        self.loaded = manifest
        self.resumed_from = directory
        if rank == 0:
            resized = "" if same_world else f" (saved on {manifest.world_size} rank(s))"
            mapped = f" ({prefix!r} of the saved names dropped)" if prefix else ""
            print(f"lamina checkpoint: resumed from {directory}{resized}{mapped}", flush=True)
        return manifest.step


def _runtime() -> Any:
    from lamina.session import current

    return current()


def _device() -> tuple[Any, Any]:
    runtime = _runtime()
    if runtime is None:
        return None, None
    return runtime.handle, runtime.device


def _lamina_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lamina-core")
    except PackageNotFoundError:
        return "unknown"


def _maybe_die(point: str, rank: int, step: int, root: Path) -> None:
    """The crash tests' kill point (see the module docstring)."""
    spec = os.environ.get(KILL_ENV, "")
    if not spec:
        return
    parts = spec.split(":")
    if (
        len(parts) not in (2, 3)
        or parts[0] not in KILL_POINTS
        or not all(p.isdigit() for p in parts[1:])
    ):
        raise ConfigError(
            f"{KILL_ENV}={spec!r}: use POINT:RANK[:STEP] with POINT one of {list(KILL_POINTS)}"
        )
    where, who = parts[0], int(parts[1])
    only = int(parts[2]) if len(parts) == 3 else step
    marker = root / f".killed-{where}-{who}"
    if where != point or who != rank or only != step or marker.exists():
        return
    marker.touch()
    fsync_dir(root)
    os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["CheckpointManager", "tensor_specs"]


#: Nice value of the background writer thread where ``SCHED_IDLE`` is refused.
WRITER_NICE = 19


def _yield_to_training() -> None:
    """Put the background writer thread on ``SCHED_IDLE`` (else nice 19), so the
    training's threads run first and the save takes the CPU they leave; waiting for the
    save (the next ``save``, ``wait``, ``close``) leaves it the CPU. Linux schedules
    threads one by one (elsewhere these calls would lower the whole process: left alone)."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # not permitted: the writer keeps its priority
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
