"""A unit's gradient path: from its parameters' gradients to their shards' ``.grad``.

The gradients of one backward of the unit (None for a parameter autograd did not reach)
are laid out rank-major in one fused copy, with one used-flag per parameter, and summed
with those of the unit's earlier calls in the same backward (a unit called more than
once in a forward sums its gradients into one reduce-scatter). The reduce-scatter
starts asynchronously, on the communication stream where the device has one (in two
phases, inside then across hosts, for a hierarchical unit; the codec's, where the plan
compresses it). Finishing it waits for it and averages it (from a codec's sum, or, where
some rank flagged it, from the exact reduce-scatter redone), averages it across the
replicas with an all-reduce (HSDP: started asynchronously, so that it runs beside the
rest of backward, and finished at its end; compressed where that is the codec's role,
then done at once), and gives each parameter some rank used its shard of the gradient;
a parameter no rank used keeps ``grad=None``, so the optimizer leaves it exactly as it
is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lamina.dtypes import dtype_name
from lamina.memory.compressed import exact_all_reduce, usable
from lamina.memory.gather import reduce_scatter_start
from lamina.memory.streams import CommStreams, on_comm, ready_for_comm, wait_comm
from lamina.memory.unit_config import UnitConfig


@dataclass
class Scattering:
    """A reduce-scatter in flight, until it is finished."""

    #: What to wait for (None: nothing).
    work: Any
    #: This rank's slot of the result, once ``work`` is done.
    result: Callable[[], torch.Tensor]
    #: The reduce-scatter's input: it lives until the work is waited for.
    scatter_in: torch.Tensor


class UnitReduce:
    """A unit's gradient path on this rank: the gradients summed over its calls, the
    reduce-scatter in flight, and the codec's trace record."""

    def __init__(self, config: UnitConfig) -> None:
        self.config = config
        #: The reduce-scatter in flight (None: none).
        self.scattering: Scattering | None = None
        #: Calls of the unit in this forward whose backward has not run yet: a unit
        #: called twice stays gathered, and sums its gradients, until the last of them.
        self.open_calls = 0
        #: Gradients (reduce-scatter input) summed over the backwards run so far, while
        #: ``open_calls`` is not zero.
        self.pending_grads: torch.Tensor | None = None
        #: The trace record the codec's statistics go to (of its collective in flight).
        self.codec_trace: Any = None
        #: HSDP: the replicas' all-reduce in flight and the shard gradient it sums.
        self.replicating: tuple[Any, torch.Tensor] | None = None

    def add_gradients(self, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """The reduce-scatter input of ``grads`` (in parameter order; None for a parameter
        autograd did not reach), in the shard's dtype, with one used-flag per parameter,
        summed with the gradients of the unit's earlier calls in this backward."""
        shard = self.config.shard
        flags = torch.tensor([g is not None for g in grads], dtype=shard.dtype, device=shard.device)
        scatter_in = self.config.layout.scatter_input_of(grads, flags)
        if self.pending_grads is not None:
            scatter_in.add_(self.pending_grads)
            self.pending_grads = None
        return scatter_in

    def start_scatter(self, scatter_in: torch.Tensor, streams: CommStreams | None) -> None:
        """Start the reduce-scatter of ``scatter_in`` (from :meth:`add_gradients`)
        asynchronously, on the communication stream where there is one."""
        config = self.config
        primitive = config.scatter_primitive or config.primitive
        ready_for_comm(streams)
        nbytes: int | None = None
        if config.codec is not None and config.codec_role == "scatter":
            nbytes, wire = config.codec.wire(
                "scatter", scatter_in.numel(), config.layout.world_size
            )
        else:
            wire = config.phased(scatter_in.numel(), scatter_in.dtype)
        with on_comm(streams), config.traced("scatter", nbytes, wire) as handle:
            work: Any
            if config.codec is not None and config.codec_role == "scatter":
                work, result = config.codec.start_scatter(scatter_in, config.group)
                self.codec_trace = handle.event if handle is not None else None
            elif config.hierarchy is not None:
                work, result = config.hierarchy.reduce_scatter_start(scatter_in)
            else:
                work, result = reduce_scatter_start(
                    scatter_in, config.rank, config.layout.world_size, primitive, config.group
                )
            if handle is not None:
                handle.work = work
        self.scattering = Scattering(work, result, scatter_in)  # the input lives until waited for

    def flush_scatter(self, streams: CommStreams | None) -> None:
        """At the end of backward: start the reduce-scatter of gradients still summed here
        (a call of the unit never got its backward), then finish it."""
        self.open_calls = 0
        if self.pending_grads is not None:
            grads, self.pending_grads = self.pending_grads, None
            self.start_scatter(grads, streams)
        self.finish_scatter(streams)
        self.finish_replicate()

    def finish_scatter(self, streams: CommStreams | None) -> None:
        """Wait for the reduce-scatter in flight (if any), average (across replicas too)
        and set the gradient of every parameter some rank used."""
        if self.scattering is None:
            return
        scattering, self.scattering = self.scattering, None
        if scattering.work is not None:
            scattering.work.wait()
        wait_comm(streams)
        shard_grad: torch.Tensor = scattering.result()  # the mean over the shard group
        config = self.config
        if config.codec is not None and config.codec_role == "scatter":
            shard_grad = self._checked_scatter(shard_grad, scattering.scatter_in, streams)
        if config.replicas > 1:  # HSDP: the same shard on every replica, averaged across them
            shard_grad.div_(config.replicas)
            if self._replicate(shard_grad):
                return  # in flight: finish_replicate sets the gradients
        self._set_grads(shard_grad)

    def finish_replicate(self) -> None:
        """Wait for the replicas' all-reduce in flight (if any) and set the gradients
        from it (at the end of backward: until then it runs beside the compute)."""
        if self.replicating is None:
            return
        (work, shard_grad), self.replicating = self.replicating, None
        work.wait()
        self._set_grads(shard_grad)

    def _checked_scatter(
        self, summed: torch.Tensor, scatter_in: torch.Tensor, streams: CommStreams | None
    ) -> torch.Tensor:
        """The mean from the codec's sum, or, where some rank flagged it (every rank of
        the group sees a non-finite sum), from the exact reduce-scatter redone now."""
        config = self.config
        assert config.codec is not None
        world = config.layout.world_size
        if self._codec_result(usable(summed), "scatter"):
            return summed.div_(world)
        wire = scatter_in if config.codec.fallback == "fp32" else scatter_in.to(torch.bfloat16)
        primitive = config.scatter_primitive or config.primitive
        with on_comm(streams), config.traced("scatter", _nbytes(wire), _one_call(wire)):
            work, result = reduce_scatter_start(wire, config.rank, world, primitive, config.group)
            if work is not None:
                work.wait()
        wait_comm(streams)
        return result().to(config.shard.dtype)

    def _replicate(self, shard_grad: torch.Tensor) -> bool:
        """Sum the (pre-averaged) shard gradient across the replicas, in place: started
        asynchronously (True: :meth:`finish_replicate` finishes it), or, compressed,
        done before it returns (False)."""
        config = self.config
        codec = config.codec if config.codec_role == "replicate" else None
        if codec is None:
            self.finish_replicate()  # one in flight per unit
            call = _one_call(shard_grad)
            with config.traced("replicate", _nbytes(shard_grad), call) as handle:
                work = dist.all_reduce(shard_grad, group=config.replicate_group, async_op=True)
                if handle is not None:
                    handle.work = work
            self.replicating = (work, shard_grad)
            return True
        nbytes, wire = codec.wire("replicate", shard_grad.numel(), config.replicas)
        with config.traced("replicate", nbytes, wire) as handle:
            summed = codec.all_reduce(shard_grad, config.replicate_group)
            self.codec_trace = handle.event if handle is not None else None
        if self._codec_result(usable(summed), "replicate"):
            shard_grad.copy_(summed[: shard_grad.numel()])
            return False
        dtype = shard_grad.dtype if codec.fallback == "fp32" else torch.bfloat16
        exact = {dtype_name(dtype): shard_grad.numel() * dtype.itemsize}
        with config.traced("replicate", sum(exact.values()), exact):
            exact_all_reduce(shard_grad, config.replicate_group, codec.fallback)
        return False

    def _codec_result(self, ok: bool, role: str) -> bool:
        """Record the codec's step (residuals, trace, a fallback taken); returns ``ok``."""
        config = self.config
        assert config.codec is not None
        config.codec.commit(ok)
        event, self.codec_trace = self.codec_trace, None
        if ok and event is None:  # statistics wait for the device: only when wanted
            return ok
        stats = config.codec.stats()
        if event is not None:
            event.codec = {**stats, "role": role, "used": ok}
        if not ok and config.observer is not None:
            why = stats.get("flagged") or "another rank flagged it (or the sum is not finite)"
            node = config.nodes.get(role, f"{config.layout.name}.{role}")
            what = f"{config.codec.name} sum not used"
            config.observer.fallback(node, config.codec.fallback, f"{what}: {why}")
        return ok

    def _set_grads(self, shard_grad: torch.Tensor) -> None:
        """Give every parameter some rank used its shard of ``shard_grad``."""
        config = self.config
        layout = config.layout
        flags = shard_grad[layout.flag_offset : layout.flag_offset + len(layout.params)]
        used = (flags > 0).tolist()
        locals_ = layout.local_views(shard_grad, config.rank)
        for k, p in enumerate(layout.params):
            if not used[k]:
                continue  # no rank used it: grad stays as it was (None), as under DDP
            param = config.params[p.name]
            local = locals_[p.name]
            if param.grad is None:
                param.grad = config.make_grad(param, local)
            else:
                _local_of(param.grad).add_(local)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _one_call(tensor: torch.Tensor) -> dict[str, int]:
    """What one collective call of ``tensor`` hands to ``torch.distributed``."""
    return {dtype_name(tensor.dtype): _nbytes(tensor)}


def _local_of(tensor: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = getattr(tensor, "_local_tensor", tensor)
    return local
