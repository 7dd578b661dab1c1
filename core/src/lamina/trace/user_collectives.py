"""Record the collectives user code calls through ``torch.distributed`` (optional).

``$LAMINA_TRACE_USER=1`` (with ``$LAMINA_TRACE=DIR``) makes ``lamina.init()`` call
:func:`install`, which replaces ``all_reduce``, ``broadcast``, ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``,
``all_to_all_single`` and ``barrier`` (and the newer ``*_single`` names where torch has
them) on ``torch.distributed`` and ``torch.distributed.distributed_c10d`` by wrappers
that record each call as a ``source="user"`` collective. Calls lamina makes itself are
already recorded by its run log and are skipped, and so is the inner call of a wrapped
function that forwards to another (``all_gather_into_tensor`` -> ``all_gather_single``).

Only calls looked up on the modules at call time are seen: a name imported with
``from torch.distributed import all_reduce`` before :func:`install` keeps the original.
A blocking call completes when it returns (on CUDA that is when it is enqueued); an
``async_op=True`` call completes with its work's future.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.trace.recorder import TRACE_ENV, TraceRecorder, inside_lamina_collective

TRACE_USER_ENV = "LAMINA_TRACE_USER"

#: function name -> (recorded op, the argument whose size is recorded; None: no data).
#: Sizes follow the spec: all_gather records its output, reduce_scatter its input.
WRAPPED: dict[str, tuple[str, str | None]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "barrier": ("barrier", None),
}

_ORIGINALS: dict[str, Callable[..., Any]] = {}
_RECORDER: TraceRecorder | None = None
_LOCAL = threading.local()


def install(recorder: TraceRecorder) -> None:
    """Record user collectives into ``recorder`` from now on (idempotent)."""
    global _RECORDER
    _RECORDER = recorder
    if _ORIGINALS:
        return
    for name, (op, sized) in WRAPPED.items():
        original = getattr(c10d, name, None)
        if original is None:
            continue
        _ORIGINALS[name] = original
        wrapper = _wrap(original, op, sized)
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)


def uninstall() -> None:
    """Put the original ``torch.distributed`` functions back (call at shutdown)."""
    global _RECORDER
    _RECORDER = None
    for name, original in _ORIGINALS.items():
        wrapper = getattr(c10d, name, None)
        setattr(c10d, name, original)
        if getattr(dist, name, None) is wrapper:
            setattr(dist, name, original)
    _ORIGINALS.clear()


def installed() -> bool:
    """True while the wrappers are in place."""
    return bool(_ORIGINALS)


def install_from_env(recorder: TraceRecorder | None) -> bool:
    """:func:`install` when ``$LAMINA_TRACE_USER`` is on; True when it installed."""
    raw = os.environ.get(TRACE_USER_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw not in ("1", "true", "yes", "on"):
        raise ConfigError(f"{TRACE_USER_ENV}={raw!r} must be 1 or 0")
    if recorder is None:
        raise ConfigError(f"{TRACE_USER_ENV}=1 needs {TRACE_ENV}=DIR to record into; set both")
    install(recorder)
    return True


def _wrap(original: Callable[..., Any], op: str, sized: str | None) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        recorder = _RECORDER
        if (
            recorder is None
            or not recorder.enabled
            or _depth() > 0
            or inside_lamina_collective()
            or torch.compiler.is_compiling()
        ):
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch reports the bad call itself
        group = _group_ranks(bound.arguments.get("group"))
        if group is None:
            return original(*args, **kwargs)
        dtype, numel, nbytes, wire = _size(bound.arguments.get(sized) if sized else None)
        _LOCAL.depth = _depth() + 1
        try:
            with recorder.collective(
                op=op,
                group=group,
                dtype=dtype,
                numel=numel,
                nbytes=nbytes,
                node="user",
                source="user",
                wire=wire,
            ) as handle:
                if handle.event is not None:
                    handle.event.source = "user"  # whatever the recorder version stamps
                try:
                    result = original(*args, **kwargs)
                except BaseException:
                    if handle.event is not None:  # it ended, with an error: not a hang
                        handle.event.end_ns = time.time_ns()
                    raise
                if bound.arguments.get("async_op") and _is_work(result):
                    handle.work = result
        finally:
            _LOCAL.depth -= 1
        return result

    return traced


def _depth() -> int:
    depth: int = getattr(_LOCAL, "depth", 0)
    return depth


def _is_work(result: Any) -> bool:
    illegal = getattr(c10d, "_IllegalWork", None)  # inside a coalescing manager
    return result is not None and not (illegal is not None and isinstance(result, illegal))


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    """Global ranks of ``group`` (None: the world); None when this rank is not in it."""
    if not dist.is_initialized():
        return None
    if group is None or group is c10d.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    if group is c10d.GroupMember.NON_GROUP_MEMBER:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError, KeyError):
        return None


def _size(value: Any) -> tuple[str, int, int, dict[str, int]]:
    """``(dtype, numel, bytes, bytes per dtype)`` of a tensor or a list of tensors."""
    tensors = [value] if isinstance(value, torch.Tensor) else list(value or [])
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return "none", 0, 0, {}
    numel = sum(t.numel() for t in tensors)
    wire: dict[str, int] = {}
    for t in tensors:
        name = dtype_name(t.dtype)
        wire[name] = wire.get(name, 0) + t.numel() * t.element_size()
    return dtype_name(tensors[0].dtype), numel, sum(wire.values()), wire
