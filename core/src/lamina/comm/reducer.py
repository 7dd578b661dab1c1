"""The gradient reducer: bucket storage, readiness hooks, async all-reduce during backward.

Each planned bucket owns one flat buffer; every parameter's ``.grad`` becomes a view
into its bucket's slot, so gradients land in bucket storage and a full bucket is reduced
in place. A post-accumulate-grad hook marks a parameter ready; when the last parameter of
a bucket is ready its all-reduce starts asynchronously on a dedicated communication
stream from the DeviceHandle (ordered after the compute stream that wrote the
gradients; on CPU the host's queue and gloo's worker thread), while backward goes on
computing the next buckets. A callback
queued on the autograd engine runs when backward ends: it launches what did not fill,
waits for every collective, and leaves averaged gradients for the optimizer.

The strategy names each bucket's collective after its execution-plan node, gives each
bucket its all-reduce algorithm (:mod:`lamina.comm.algorithms`; ``flat`` is the group's
own all-reduce) and may give a bucket a :class:`~lamina.comm.codecs.Codec`; an
``observer`` (the run log) hears every collective issued and every codec fallback taken.

A two-phase codec (:class:`~lamina.comm.codecs.TwoPhaseCodec`: ``fp8``, or a plugin's)
sums its bucket with its own :class:`~lamina.comm.two_phase.TwoPhaseSum`: over the whole
group on the :class:`~lamina.comm.two_phase.TwoPhaseChannel` (scope ``all``), or inside
the hierarchical algorithm's inter-host phase only (scope ``inter``); the reducer has no
codec-specific branch. The result is
used when it decodes finite; otherwise (a rank flagged the bucket, the same bits on
every rank) the bucket is reduced exactly that step, with no extra collective to agree.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lamina.comm.algorithms import AlgorithmGroups
from lamina.comm.buckets import Bucket, BucketPlan
from lamina.comm.codecs import Codec, TwoPhaseCodec
from lamina.comm.two_phase import TwoPhaseChannel, TwoPhaseSum, merged_stats
from lamina.device.handle import DeviceHandle, Stream
from lamina.dtypes import dtype_name
from lamina.errors import NotSupportedError


@dataclass
class _BucketState:
    """Run-time state of one planned bucket."""

    plan: Bucket
    buffer: torch.Tensor
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    node: str = ""
    codec: Codec | None = None
    ready: set[int] = field(default_factory=set)
    #: slots whose gradient was divided by the world size as it was copied in
    divided: set[int] = field(default_factory=set)
    algorithm: str = "flat"
    chunks: int = 1
    work: Any = None
    wire: torch.Tensor | None = None
    #: two-phase codec: the sums (one per pipeline chunk), its scope, the pending
    #: result and the trace handle its statistics go to
    sums: list[TwoPhaseSum] = field(default_factory=list)
    scope: str = "all"
    result: torch.Tensor | None = None
    trace: Any = None


class CommObserver(Protocol):
    """Hears what the reducer issues (``lamina.runtime.RunLog`` is one)."""

    def collective(
        self, node_id: str, nbytes: int | None = None, wire: dict[str, int] | None = None
    ) -> AbstractContextManager[Any]:
        """Wraps issuing plan node ``node_id``'s collective (``nbytes`` as its op counts
        it; ``wire``: bytes per dtype handed to ``torch.distributed`` over all its
        calls); the handle takes ``.work``."""

    def fallback(self, node_id: str, alternative: str, reason: str) -> object:
        """Plan node ``node_id`` switched to ``alternative`` at run time."""

    def begin_backward(self) -> None:
        """The first gradient of a backward is ready."""

    def end_backward(self) -> None:
        """Backward's computation ended."""


@dataclass
class ReducerStats:
    """Counters for tests and reports: what the last backward did."""

    launched_in_backward: int = 0
    launched_at_end: int = 0
    grads_copied: int = 0
    stray_params: int = 0
    codec_fallbacks: int = 0


def stray_dtype(params: list[nn.Parameter] | list[torch.dtype]) -> torch.dtype:
    """The one dtype the excluded parameters' gradients travel in (their promoted type)."""
    dtypes = [p if isinstance(p, torch.dtype) else p.dtype for p in params]
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype


class GradientReducer:
    """Averages the gradients of ``named_params`` across ``group`` according to ``plan``.

    ``bucket_nodes[i]`` names bucket i's collective (default ``bucket<i>``),
    ``codecs[i]`` compresses it, ``excluded_node`` names the all-reduce of gradients of
    parameters the plan excluded, and ``observer`` is told about each collective.
    """

    def __init__(
        self,
        plan: BucketPlan,
        named_params: dict[str, nn.Parameter],
        group: dist.ProcessGroup | None = None,
        handle: DeviceHandle | None = None,
        *,
        bucket_nodes: list[str] | None = None,
        codecs: dict[int, Codec] | None = None,
        excluded_node: str = "excluded",
        observer: CommObserver | None = None,
        algorithms: dict[int, tuple[str, int]] | None = None,
        algorithm_groups: AlgorithmGroups | None = None,
        codec_scope: str = "all",
        channel: TwoPhaseChannel | None = None,
    ) -> None:
        self.plan = plan
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.sync_enabled = True
        self.stats = ReducerStats()
        self.observer = observer
        self._excluded_node = excluded_node
        self._buckets = [self._allocate(b, named_params) for b in plan.buckets]
        for state in self._buckets:
            index = state.plan.index
            state.node = bucket_nodes[index] if bucket_nodes else f"bucket{index}"
            state.codec = (codecs or {}).get(index)
            state.algorithm, state.chunks = (algorithms or {}).get(index, ("flat", 1))
            if state.algorithm != "flat" and algorithm_groups is None:
                raise ValueError(f"bucket {index} runs {state.algorithm!r}: pass algorithm_groups")
            if isinstance(state.codec, TwoPhaseCodec):
                self._plan_two_phase(state, state.codec, codec_scope, channel)
        self._algorithms = algorithm_groups
        self._channel = channel
        self._where: dict[nn.Parameter, tuple[_BucketState, int]] = {}
        for state in self._buckets:
            for k, param in enumerate(state.params):
                self._where[param] = (state, k)
        self._stray = [named_params[n] for n in plan.excluded if n in named_params]
        self._handle = handle
        self.comm_stream = _comm_stream(handle)
        self._lock = threading.Lock()
        self._callback_queued = False
        self._handles = [
            param.register_post_accumulate_grad_hook(self._on_grad_ready)  # type: ignore[no-untyped-call]
            for param in self._where
        ]

    @staticmethod
    def _plan_two_phase(
        state: _BucketState, codec: TwoPhaseCodec, scope: str, channel: TwoPhaseChannel | None
    ) -> None:
        state.scope = scope
        if scope == "inter":
            if state.algorithm not in ("hierarchical", "pipelined"):
                raise ValueError(
                    f"bucket {state.plan.index}: codec_scope='inter' needs an "
                    f"inter-host phase, its algorithm is {state.algorithm!r}"
                )
            state.sums = [codec.new_sum() for _ in range(max(1, state.chunks))]
            return
        if channel is None:
            raise ValueError(f"bucket {state.plan.index} is summed in two phases: pass channel")
        state.algorithm, state.sums = "flat", [codec.new_sum()]

    @staticmethod
    def _allocate(bucket: Bucket, named_params: dict[str, nn.Parameter]) -> _BucketState:
        params = [named_params[s.name] for s in bucket.slots]
        device = params[0].device
        buffer = torch.zeros(bucket.numel, dtype=params[0].dtype, device=device)
        views = [
            buffer.narrow(0, slot.offset, slot.numel).view(slot.shape) for slot in bucket.slots
        ]
        for param, view in zip(params, views, strict=True):
            if param.grad is not None:  # keep gradients that already exist
                view.copy_(param.grad)
                param.grad = view
        return _BucketState(bucket, buffer, params, views)

    # -- hooks ---------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        state, k = self._where[param]  # type: ignore[index]
        with self._lock:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
                if self.observer is not None:
                    self.observer.begin_backward()
            self._land_in_bucket(state, k)
            state.ready.add(k)
            if len(state.ready) == len(state.params) and state.work is None:
                self._launch(state)
                self.stats.launched_in_backward += 1

    def _land_in_bucket(self, state: _BucketState, k: int) -> None:
        param, view = state.params[k], state.views[k]
        grad = param.grad
        if grad is None or (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape):
            return
        if self.world_size > 1 and grad.dtype == view.dtype:
            # copy and average in one pass (the same x / world_size as _issue's div_)
            torch.div(grad, self.world_size, out=view)
            state.divided.add(k)
        else:
            view.copy_(grad)
        param.grad = view
        self.stats.grads_copied += 1

    def _launch(self, state: _BucketState) -> None:
        if self.world_size == 1:
            state.work = _DONE
            return
        if self._handle is None or self.comm_stream is None:
            self._issue(state)
            return
        # the bucket's gradients were written on the compute stream: order after them
        self.comm_stream.wait_stream(self._handle.current_stream())
        with self._handle.use_stream(self.comm_stream):
            self._issue(state)

    def _issue(self, state: _BucketState) -> None:
        if not state.divided:
            state.buffer.div_(self.world_size)
        elif len(state.divided) < len(state.views):  # only the slots not divided on landing
            for k, view in enumerate(state.views):
                if k not in state.divided:
                    view.div_(self.world_size)
        if state.sums:
            self._issue_two_phase(state)
            return
        payload = state.buffer
        if state.codec is not None:
            payload = state.wire = state.codec.encode(state.buffer)
        wire = self._algorithm_wire(state, payload.numel(), payload.element_size())
        with self._traced(state.node, _nbytes(payload), {_dtype(payload): wire}) as handle:
            if state.algorithm == "flat" or self._algorithms is None:
                state.work = dist.all_reduce(payload, group=self.group, async_op=True)
            else:
                state.work = self._algorithms.all_reduce(state.algorithm, payload, state.chunks)
            if handle is not None:
                handle.work = state.work

    def _issue_two_phase(self, state: _BucketState) -> None:
        """Start the bucket's two-phase sum (see the module docstring)."""
        buffer, sums, codec = state.buffer, state.sums, state.codec
        assert isinstance(codec, TwoPhaseCodec)
        if state.scope == "inter":
            assert self._algorithms is not None
            result = state.result = buffer.clone()  # the bucket stays for a fallback

            def inter_sum(k: int, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
                shard.copy_(sums[k].run(shard, group)[: shard.numel()])

            wire = self._inter_wire(state)
            with self._traced(state.node, _nbytes(buffer), wire) as handle:
                state.work = self._algorithms.all_reduce(
                    state.algorithm, result, state.chunks, inter_sum
                )
                state.trace = handle.event if handle is not None else None
                if handle is not None:
                    handle.work = state.work
            return
        assert self._channel is not None
        group = self._channel.group

        def run() -> None:
            state.result = sums[0].run(buffer, group)

        nbytes = codec.nbytes(buffer.numel(), self.world_size)
        wire = codec.wire(buffer.numel(), self.world_size)
        with self._traced(state.node, nbytes, wire) as handle:
            state.work = self._channel.submit(run)
            state.trace = handle.event if handle is not None else None
            if handle is not None:
                handle.work = state.work

    def _traced(
        self, node: str, nbytes: int, wire: dict[str, int] | None = None
    ) -> AbstractContextManager[Any]:
        """Around issuing ``node``'s collective: ``nbytes`` as its op counts them, ``wire``
        what its calls hand to ``torch.distributed`` (default: one call of ``nbytes``)."""
        if self.observer is None:
            return nullcontext(None)
        return self.observer.collective(node, nbytes, wire)

    def _algorithm_wire(self, state: _BucketState, numel: int, element_size: int) -> int:
        """Bytes the bucket's all-reduce algorithm hands to ``torch.distributed`` for a
        payload of ``numel`` elements: one all-reduce (``flat``, ``ordered``); per
        pipeline chunk of ``piece`` elements (padded to whole per-host shards), the
        intra-host reduce-scatter's input and all-gather's output (``piece`` each) and
        the inter-host all-reduce of the ``piece / L`` shard (hierarchical, pipelined)."""
        groups = self._algorithms
        if state.algorithm in ("flat", "ordered") or groups is None or groups.layout.size == 1:
            return numel * element_size
        piece, stages, local = self._pieces(state, numel)
        return stages * (2 * piece + piece // local) * element_size

    def _pieces(self, state: _BucketState, numel: int) -> tuple[int, int, int]:
        """``(piece, stages, ranks per host)`` of the hierarchical algorithms' chunks, as
        :meth:`AlgorithmGroups.all_reduce` cuts a buffer of ``numel`` elements."""
        assert self._algorithms is not None
        local = self._algorithms.layout.per_host
        stages = max(1, state.chunks) if state.algorithm == "pipelined" else 1
        return -(-numel // (stages * local)) * local, stages, local

    def _inter_wire(self, state: _BucketState) -> dict[str, int]:
        """Bytes per dtype of the hierarchical all-reduce whose inter-host phase is the
        codec's two-phase sum: the intra-host phases in the bucket's dtype, and per chunk
        the codec's sum of its ``piece / L`` shard over the hosts."""
        assert self._algorithms is not None and isinstance(state.codec, TwoPhaseCodec)
        numel, size = state.buffer.numel(), state.buffer.element_size()
        piece, stages, local = self._pieces(state, numel)
        hosts = self._algorithms.layout.host_count
        wire = {_dtype(state.buffer): stages * 2 * piece * size}
        for dtype, nbytes in state.codec.wire(piece // local, hosts).items():
            wire[dtype] = stages * nbytes
        return wire

    def _complete_two_phase(self, state: _BucketState) -> None:
        """Use the two-phase sum when it decoded finite, else reduce the bucket exactly
        (every rank decoded the same bits, so every rank decides the same way)."""
        result, state.result = state.result, None
        assert result is not None and isinstance(state.codec, TwoPhaseCodec)
        if self._handle is not None and self.comm_stream is not None:
            # the sum was written on the communication stream: read it after it
            self._handle.current_stream().wait_stream(self.comm_stream)
        ok = bool(torch.isfinite(result).all())
        for one in state.sums:
            one.commit(ok)
        event, state.trace = state.trace, None
        if ok and event is None:  # statistics wait for the device: only when wanted
            state.buffer.copy_(result[: state.buffer.numel()])
            return
        stats = merged_stats([one.stats() for one in state.sums])
        if event is not None:
            event.codec = {**stats.as_dict(), "scope": state.scope, "used": ok}
        if ok:
            state.buffer.copy_(result[: state.buffer.numel()])
            return
        self.stats.codec_fallbacks += 1
        fallback = state.codec.fallback
        if self.observer is not None:
            why = stats.flagged or "another rank flagged it (or the sum is not finite)"
            what = f"{state.codec.name} sum not used"
            self.observer.fallback(state.node, fallback, f"{what}: {why}")
        payload = state.buffer if fallback == "fp32" else state.buffer.to(torch.bfloat16)
        with self._traced(state.node, _nbytes(payload), _one_call(payload)):  # this rank's share
            dist.all_reduce(payload, group=self.group)
        if payload is not state.buffer:
            state.buffer.copy_(payload)

    def _complete(self, state: _BucketState) -> None:
        """Wait for the bucket; decode a compressed one (resent uncompressed on overflow)."""
        state.work.wait()
        state.work = None
        if state.sums and self.world_size > 1:
            self._complete_two_phase(state)
            return
        wire, state.wire = state.wire, None
        if wire is None or state.codec is None:
            return
        if bool(torch.isfinite(wire).all()):  # the same bits on every rank: same decision
            state.codec.decode(wire, state.buffer)
            return
        self.stats.codec_fallbacks += 1
        if self.observer is not None:
            self.observer.fallback(
                state.node,
                "uncompressed",
                f"codec {state.codec.name} overflowed: resent uncompressed",
            )
        with self._traced(state.node, _nbytes(state.buffer), _one_call(state.buffer)):
            dist.all_reduce(state.buffer, group=self.group)

    def _finish_backward(self) -> None:
        """End of backward: launch partial buckets, wait for all, reset for the next step."""
        with self._lock:
            self._callback_queued = False
            if self.observer is not None:
                self.observer.end_backward()
            for state in self._buckets:
                if state.work is None:
                    for k, view in enumerate(state.views):
                        if k not in state.ready:
                            self._land_or_zero(state, k, view)
                    self._launch(state)
                    self.stats.launched_at_end += 1
            for state in self._buckets:
                self._complete(state)
                state.ready.clear()
                state.divided.clear()
            if self._handle is not None and self.comm_stream is not None:
                self._handle.current_stream().wait_stream(self.comm_stream)
            self._reduce_strays()

    def _land_or_zero(self, state: _BucketState, k: int, view: torch.Tensor) -> None:
        if state.params[k].grad is None:
            view.zero_()  # no gradient this step on this rank: contribute zeros
            state.divided.add(k)  # zero over the world size is zero
        else:
            self._land_in_bucket(state, k)

    def _reduce_strays(self) -> None:
        """Parameters the plan excluded as unused that got a gradient anyway: averaged.

        One all-reduce per step on every rank, whether or not this rank has a gradient
        (a rank cannot know whether another one has: a data-dependent branch may use a
        parameter on some ranks only, and a collective issued on some ranks only would
        hang or pair with the wrong one). The buffer holds each parameter's gradient
        (zeros where this rank has none) and one used-flag per parameter; a parameter no
        rank used keeps ``grad=None``, as under DDP.
        """
        if not self._stray or self.world_size == 1:
            return
        dtype = stray_dtype(self._stray)
        flags = torch.tensor([float(p.grad is not None) for p in self._stray], dtype=dtype).to(
            self._stray[0].device
        )
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
            for p in self._stray
        ]
        buffer = torch.cat([*grads, flags]).div_(self.world_size)
        with self._traced(self._excluded_node, _nbytes(buffer), _one_call(buffer)):
            dist.all_reduce(buffer, group=self.group)
        used = buffer[-len(self._stray) :].tolist()
        offset = 0
        for param, flag in zip(self._stray, used, strict=True):
            n = param.numel()
            if flag > 0:
                mean = buffer[offset : offset + n].view_as(param).to(param.dtype)
                if param.grad is None:
                    param.grad = mean.clone()
                else:
                    param.grad.copy_(mean)
                self.stats.stray_params += 1
            offset += n

    # -- user-facing controls ------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronizes."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def residual_bytes(self) -> int:
        """Bytes the two-phase codecs' error feedback holds now, on this rank."""
        return sum(one.residual_nbytes() for state in self._buckets for one in state.sums)

    def remove(self) -> None:
        """Detach the hooks (and stop the worker threads)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._algorithms is not None:
            self._algorithms.close()
        if self._channel is not None:
            self._channel.close()


def _comm_stream(handle: DeviceHandle | None) -> Stream | None:
    """A dedicated communication stream, or None where the device has no streams (XLA)."""
    if handle is None:
        return None
    try:
        return handle.new_stream()
    except NotSupportedError:
        return None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _dtype(tensor: torch.Tensor) -> str:
    return dtype_name(tensor.dtype)


def _one_call(tensor: torch.Tensor) -> dict[str, int]:
    """What one collective call of ``tensor`` hands to ``torch.distributed``."""
    return {_dtype(tensor): _nbytes(tensor)}


class _Done:
    def wait(self) -> bool:
        return True


_DONE = _Done()

__all__ = ["GradientReducer", "ReducerStats"]
