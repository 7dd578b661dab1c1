"""Backends that the conformance kit must pass or fail: tests/test_conformance_kit.py.

``kit-async`` is an emulated *asynchronous* device on the host CPU, correct in every
respect. Every other ``kit-*`` backend is the same device with one fault (a constant
memory figure, a no-op ``wait_stream``, a wrong kernel, kernels that flush small outputs
or denormals to zero, corrupted collectives...), named
in :data:`BACKENDS`; ``kit-xla-like`` lacks what XLA on PJRT CPU lacks, honestly.
test_conformance_kit.py installs this module as a lamina plugin through a throwaway
distribution's entry point, so spawned ranks find it too.

The emulated device. The current stream is the host: work issued there runs at once,
as on the CPU backend. A stream from ``new_stream`` is a queue with a worker thread:
under ``use_stream(side)`` a ``TorchDispatchMode`` turns every op into a job on that
queue and returns outputs that the job fills in later (shapes from running the op on
meta tensors; in-place ops return their target; views run at once, since they compute
nothing). An idle worker starts :data:`START_DELAY` seconds after it is handed work, as
a device picks up a launch late. So a read on the host stream sees a side stream's
write only after ``wait_stream`` / ``wait_event`` / ``synchronize`` drained the queue,
as on a GPU, and a no-op wait loses that race by a wide margin.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lamina.backends.cpu import CpuBackend, CpuHandle
from lamina.backends.cpu_kernels import (
    fp8_dequantize_table,
    fp8_quantize_exp2,
    pack_bucket_cat,
    scale_accumulate_add,
)
from lamina.device.backend import Backend
from lamina.device.handle import DeviceHandle, Event, MemoryStats, Stream
from lamina.device.kernels import KernelRegistry, LaunchConfig, check_scale_accumulate_args
from lamina.errors import NotSupportedError
from lamina.hookspecs import hookimpl

#: Seconds an idle side stream waits before it starts on newly queued work.
START_DELAY = 0.1

# --------------------------------------------------------------------------- the device


class _Worker:
    """The device side of one emulated stream: a FIFO of jobs run by one thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name="kit-stream", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        if self.idle():
            self._jobs.put(functools.partial(time.sleep, START_DELAY))
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def drain(self) -> None:
        """Block until every job submitted so far has run."""
        self._jobs.join()
        if self._error is not None:
            raise RuntimeError("a job on an emulated stream failed") from self._error

    def idle(self) -> bool:
        return self._jobs.unfinished_tasks == 0

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except BaseException as exc:  # kept for drain(): a device error surfaces at sync
                self._error = exc
            finally:
                self._jobs.task_done()


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def _written(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The arguments an in-place / ``out=`` op returns (its schema's write aliases)."""
    bound = {a.name: v for a, v in zip(schema.arguments, args, strict=False)}
    bound.update(kwargs)
    outs = []
    for ret in schema.returns:
        target = ret.alias_info.before_set if ret.alias_info is not None else None
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.before_set == target:
                outs.append(bound[arg.name])
                break
    if not outs:
        return None
    return outs[0] if len(outs) == 1 else tuple(outs)


class _Deferred(TorchDispatchMode):
    """Queues every op issued under it on ``worker``; outputs are filled in when it runs."""

    def __init__(self, worker: _Worker) -> None:
        super().__init__()
        self.worker = worker

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        returns = [r.alias_info for r in schema.returns]
        if any(info is not None and not info.is_write for info in returns):
            return func(*args, **kwargs)  # a view computes nothing: make it now
        if schema.is_mutable:
            self.worker.submit(lambda: func(*args, **kwargs))
            return _written(schema, args, kwargs)
        try:
            meta = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        except (NotImplementedError, RuntimeError):
            meta = None
        flat, spec = tree_flatten(meta)
        if meta is None or not all(isinstance(m, torch.Tensor) for m in flat):
            self.worker.drain()  # a data-dependent op (.item()): the host waits for the stream
            return func(*args, **kwargs)
        outs = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype) for m in flat]

        def job() -> None:
            values, _ = tree_flatten(func(*args, **kwargs))
            for out, value in zip(outs, values, strict=True):
                out.copy_(value)

        self.worker.submit(job)
        return tree_unflatten(outs, spec)


class KitStream(Stream):
    """An emulated stream: ``worker`` is None for the host stream (work runs at once)."""

    def __init__(self, handle: KitHandle, worker: _Worker | None) -> None:
        self.handle = handle
        self.worker = worker

    def synchronize(self) -> None:
        if "noop-synchronize" not in self.handle.faults and self.worker is not None:
            self.worker.drain()

    def query(self) -> bool:
        return self.worker is None or self.worker.idle()

    def wait_event(self, event: Event) -> None:
        if "noop-wait-event" not in self.handle.faults:
            self._wait(event)

    def wait_stream(self, other: Stream) -> None:
        if "noop-wait-stream" not in self.handle.faults:
            self._wait(other.record_event())

    def _wait(self, event: Event) -> None:
        if self.worker is None:
            event.synchronize()  # the host stream waits by blocking the host
        else:
            self.worker.submit(event.synchronize)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or KitEvent(self.handle)
        event.record(self)
        return event


class KitEvent(Event):
    """A host timestamp taken when the stream it was recorded on reaches it."""

    def __init__(self, handle: KitHandle, enable_timing: bool = True) -> None:
        self.handle = handle
        self.enable_timing = enable_timing
        self._done = threading.Event()
        self._done.set()  # never recorded: complete, as torch's events
        self._stamp_ns: int | None = None
        if "creation-stamped" in handle.faults:
            self._stamp_ns = time.perf_counter_ns()

    def record(self, stream: Stream | None = None) -> None:
        target = stream or self.handle.current_stream()
        assert isinstance(target, KitStream)
        if "creation-stamped" in self.handle.faults:
            return
        self._done.clear()
        if target.worker is None:
            self._mark()
        else:
            target.worker.submit(self._mark)

    def _mark(self) -> None:
        self._stamp_ns = time.perf_counter_ns()
        self._done.set()

    def wait(self, stream: Stream | None = None) -> None:
        (stream or self.handle.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        if "noop-synchronize" not in self.handle.faults:
            self._done.wait()

    def query(self) -> bool:
        return self._done.is_set()

    def elapsed_time(self, end: Event) -> float:
        faults = self.handle.faults
        if "elapsed-unsupported" in faults:
            raise NotSupportedError("kit: this device has events but no timer")
        assert isinstance(end, KitEvent)
        if self._stamp_ns is None or end._stamp_ns is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        ms = (end._stamp_ns - self._stamp_ns) / 1e6
        if "zero-elapsed" in faults:
            return 0.0
        return -ms if "reversed-elapsed" in faults else ms


_NO_STREAMS = "kit: this device runs one queue; there are no user streams"


class KitHandle(CpuHandle):
    """The emulated device (host memory, RNG and dtypes are the CPU handle's), with faults."""

    def __init__(self, faults: frozenset[str]) -> None:
        super().__init__()
        self.faults = faults
        self._host = KitStream(self, None)
        self._current = threading.local()
        self._side: weakref.WeakSet[KitStream] = weakref.WeakSet()

    def memory_stats(self, device: torch.device | None = None) -> MemoryStats:
        if "xla-like" in self.faults:
            return MemoryStats(None, None, None, "device")
        if "constant-memory" in self.faults:
            return MemoryStats(2**30, 2**30, 2**30, "process")
        return super().memory_stats(device)

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        if "xla-like" in self.faults:
            raise NotSupportedError("kit: no call resets the peak")
        if "noop-peak-reset" not in self.faults:
            super().reset_peak_memory(device)

    def new_stream(self, device: torch.device | None = None) -> Stream:
        if self.faults & {"no-streams", "xla-like"}:
            raise NotSupportedError(_NO_STREAMS)
        if "same-stream" in self.faults:
            return self.current_stream(device)
        stream = KitStream(self, _Worker())
        assert stream.worker is not None
        weakref.finalize(stream, stream.worker.close)
        self._side.add(stream)
        return stream

    def current_stream(self, device: torch.device | None = None) -> Stream:
        if "xla-like" in self.faults:
            raise NotSupportedError(_NO_STREAMS)
        stack: list[KitStream] = getattr(self._current, "stack", [])
        return stack[-1] if stack else self._host

    def use_stream(self, stream: Stream) -> AbstractContextManager[None]:
        if "xla-like" in self.faults:
            raise NotSupportedError(_NO_STREAMS)
        if not isinstance(stream, KitStream):
            raise TypeError(f"the kit device needs a KitStream, got {type(stream).__name__}")
        return self._using(stream)

    @contextmanager
    def _using(self, stream: KitStream) -> Iterator[None]:
        stack: list[KitStream] = self._current.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            if stream.worker is None:
                yield
            else:
                with _Deferred(stream.worker):
                    yield
        finally:
            stack.pop()

    def new_event(self, enable_timing: bool = True) -> Event:
        if "xla-like" in self.faults:
            raise NotSupportedError("kit: no device events; time with synchronize()")
        return KitEvent(self, enable_timing)

    def synchronize(self, device: torch.device | None = None) -> None:
        if "noop-synchronize" in self.faults:
            return
        for stream in list(self._side):
            assert stream.worker is not None
            stream.worker.drain()


# --------------------------------------------------------------------------- backends

_Issue = Callable[..., Any]
#: The torch.distributed calls the kit issues (lamina.testing.conformance._collectives._issue).
_KIT_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")


def _corrupting(issue: _Issue) -> _Issue:
    """``issue`` whose output (its first argument) is off by one once lamina is running."""

    @functools.wraps(issue)
    def wrapper(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        import lamina

        work = issue(output, *args, **kwargs)
        if lamina.current() is not None:  # leave lamina.init()'s own traffic intact
            with torch.no_grad():
                output.add_(1)
        return work

    return wrapper


def _missing(op: str) -> _Issue:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotSupportedError(f"kit: the collective library has no {op}")

    return refuse


class KitBackend(CpuBackend):
    """The emulated device under ``name``, with ``faults``; gloo collectives."""

    priority = -100

    def __init__(self, name: str, *faults: str, unsupported: frozenset[str] = frozenset()) -> None:
        self.name = name
        self.faults = frozenset(faults)
        self.unsupported_collectives = unsupported

    def handle(self) -> DeviceHandle:
        return KitHandle(self.faults)

    def prepare_process(
        self, rank: int, world_size: int, local_rank: int, local_world_size: int
    ) -> None:
        """Stand in for a faulty vendor collective library, in this rank only."""
        import torch.distributed as dist

        if "xla-like" in self.faults and world_size > 1:
            raise NotSupportedError("kit: this runtime runs one process only")
        if "corrupt-collectives" in self.faults:
            for op in (
                "all_reduce",
                "broadcast",
                "all_gather_into_tensor",
                "reduce_scatter_tensor",
            ):
                setattr(dist, op, _corrupting(getattr(dist, op)))
        if "partial-collectives" in self.faults:
            dist.all_gather_into_tensor = _missing("all_gather")  # type: ignore[assignment]
            dist.reduce_scatter_tensor = _missing("reduce_scatter")  # type: ignore[assignment]


#: Every test backend, by name: ``kit-async`` is correct, each other one has one fault.
BACKENDS: dict[str, KitBackend] = {
    b.name: b
    for b in (
        KitBackend("kit-async"),
        KitBackend("kit-constant-memory", "constant-memory"),
        KitBackend("kit-noop-peak-reset", "noop-peak-reset"),
        KitBackend("kit-zero-elapsed", "zero-elapsed"),
        KitBackend("kit-reversed-elapsed", "reversed-elapsed"),
        KitBackend("kit-creation-stamped", "creation-stamped"),
        KitBackend("kit-elapsed-unsupported", "elapsed-unsupported"),
        KitBackend("kit-noop-wait-stream", "noop-wait-stream"),
        KitBackend("kit-noop-wait-event", "noop-wait-event"),
        KitBackend("kit-noop-synchronize", "noop-synchronize"),
        KitBackend("kit-same-stream", "same-stream"),
        KitBackend("kit-no-streams", "no-streams"),
        # what XLA on PJRT CPU lacks: memory figures, peak reset, streams, events, 2 ranks
        KitBackend("kit-xla-like", "xla-like"),
        KitBackend("kit-wrong-kernel"),
        KitBackend("kit-out-of-place-kernel"),
        KitBackend("kit-copying-unpack"),
        KitBackend("kit-reference-kernel"),
        KitBackend("kit-misnamed-kernel"),
        KitBackend("kit-flush-small"),
        KitBackend("kit-flush-denormals"),
        KitBackend("kit-corrupt-collectives", "corrupt-collectives"),
        KitBackend(
            "kit-partial-collectives",
            "partial-collectives",
            unsupported=frozenset({"reduce_scatter"}),
        ),
    )
}


def _scale_ignoring_scale(
    config: LaunchConfig, dst: torch.Tensor, src: torch.Tensor, scale: float
) -> torch.Tensor:
    """Wrong: ``dst += src``, whatever the scale."""
    check_scale_accumulate_args(dst, src, scale)
    with torch.no_grad():
        dst.add_(src)
    return dst


def _scale_out_of_place(
    config: LaunchConfig, dst: torch.Tensor, src: torch.Tensor, scale: float
) -> torch.Tensor:
    """Wrong: the right sum in a new tensor; ``dst`` is left as it was."""
    check_scale_accumulate_args(dst, src, scale)
    return torch.add(dst, src, alpha=scale)


def _unpack_copies(
    config: LaunchConfig, flat: torch.Tensor, shapes: Any, out: Any = None
) -> list[torch.Tensor]:
    """Wrong: copies where the contract gives views of ``flat``."""
    views: list[torch.Tensor] = []
    offset = 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat.narrow(0, offset, n).view(tuple(shape)).clone())
        offset += n
    if out is None:
        return views
    for o, v in zip(out, views, strict=True):
        o.copy_(v)
    return list(out)


#: Below this magnitude ``kit-flush-small`` writes zeros (the kit's old absolute tolerance).
FLUSH_SMALL = 1e-6
#: fp32's smallest normal, 2**-126: ``kit-flush-denormals`` reads and writes zero below it.
FLUSH_DENORMALS = torch.finfo(torch.float32).tiny


def _flush_(value: Any, limit: float) -> Any:
    """Zero, in place and keeping the sign, every float element under ``limit`` in magnitude
    of the tensors in ``value`` (views write through to what they view)."""
    tensors, _ = tree_flatten(value)
    with torch.no_grad():
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(torch.where(t.abs() < limit, t * 0, t))
    return value


def _flushing_outputs(fn: Callable[..., Any], limit: float) -> Callable[..., Any]:
    """Wrong: ``fn``, then what it returns flushed to zero under ``limit`` (as a device
    whose arithmetic flushes small results, e.g. flush-to-zero on denormals)."""

    @functools.wraps(fn)
    def flushed(config: LaunchConfig, *args: Any, **kwargs: Any) -> Any:
        return _flush_(fn(config, *args, **kwargs), limit)

    return flushed


def _quantize_reading_denormals_as_zero(
    config: LaunchConfig, x: torch.Tensor, block: int, *args: Any, **kwargs: Any
) -> Any:
    """Wrong: ``fp8_quantize`` of ``x`` with its denormals read as zero (DAZ)."""
    return fp8_quantize_exp2(config, _flush_(x.clone(), FLUSH_DENORMALS), block, *args, **kwargs)


def _register_flushing(registry: KernelRegistry, backend: str, limit: float) -> None:
    """Every built-in kernel under ``backend``, each the right one but for the flushing."""
    right: dict[str, Callable[..., Any]] = {
        "pack_bucket": pack_bucket_cat,
        "unpack_bucket": registry.spec("unpack_bucket").reference,
        "scale_accumulate": scale_accumulate_add,
        "fp8_quantize": fp8_quantize_exp2,  # integer outputs: nothing to flush
        "fp8_dequantize": fp8_dequantize_table,
    }
    if limit == FLUSH_DENORMALS:
        right["fp8_quantize"] = _quantize_reading_denormals_as_zero
    for name, fn in right.items():
        registry.register(name, backend, _flushing_outputs(fn, limit))


@hookimpl
def lamina_register_backends() -> list[Backend]:
    """The test backends of :data:`BACKENDS`."""
    return list(BACKENDS.values())


@hookimpl
def lamina_register_kernels(registry: KernelRegistry) -> None:
    """One kernel implementation per kernel-fault backend (and correct ones for kit-async)."""
    registry.register("pack_bucket", "kit-async", pack_bucket_cat)
    registry.register("scale_accumulate", "kit-async", scale_accumulate_add)
    registry.register("scale_accumulate", "kit-wrong-kernel", _scale_ignoring_scale)
    registry.register("scale_accumulate", "kit-out-of-place-kernel", _scale_out_of_place)
    registry.register("unpack_bucket", "kit-copying-unpack", _unpack_copies)
    reference = registry.spec("scale_accumulate").reference
    registry.register("scale_accumulate", "kit-reference-kernel", reference)
    # registered under a name that is not the backend's: launches run the reference
    registry.register("scale_accumulate", "kit-misnamed-kernels", scale_accumulate_add)
    _register_flushing(registry, "kit-flush-small", FLUSH_SMALL)
    _register_flushing(registry, "kit-flush-denormals", FLUSH_DENORMALS)
