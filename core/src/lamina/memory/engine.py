"""The ZeRO-3 engine: it schedules a model's units, each gathered just in time.

A unit (:class:`UnitState`) is its configuration (:mod:`lamina.memory.unit_config`), its
gather path (:mod:`lamina.memory.unit_gather`) and its gradient path
(:mod:`lamina.memory.unit_reduce`). Before a unit's forward the engine gathers it (the
next unit's gather is started asynchronously right after, in the order the first forward
recorded) and the module's parameters are replaced by views of the unsharded buffer for
the forward; afterwards the buffer is dropped and the module holds its sharded
parameters again. Autograd keeps no reference to the buffer: a saved-tensor hook
replaces every saved view by a token, and when backward needs it the unit is gathered
again (prefetching the unit before it).

The gather is one autograd function with one output per parameter (the views), so its
backward receives each parameter's gradient, or None for a parameter autograd did not
reach, and starts the unit's reduce-scatter; backward goes on with the units before it.
When the next unit starts its reduce-scatter (at the latest when backward ends) the
earlier one is finished: at most two are in flight. A unit called more than once in a
forward stays gathered until its last backward and sums its gradients into one
reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lamina.memory.gather import Primitive
from lamina.memory.layout import UnitLayout
from lamina.memory.streams import CommStreams
from lamina.memory.unit_config import GatherObserver, UnitConfig
from lamina.memory.unit_gather import UnitGather
from lamina.memory.unit_reduce import UnitReduce


class UnitState:
    """One unit on this rank: its configuration, its gather path and its gradient path.
    The properties are the configuration and gather state that the strategy and tests
    read."""

    def __init__(self, config: UnitConfig) -> None:
        self.config = config
        self.gather = UnitGather(config)
        self.reduce = UnitReduce(config)
        self._anchor: torch.Tensor | None = None

    @property
    def layout(self) -> UnitLayout:
        """The unit's shard layout."""
        return self.config.layout

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard buffer (the parameters' local shards are views of it)."""
        return self.config.shard

    @shard.setter
    def shard(self, shard: torch.Tensor) -> None:
        """A device move's new shard buffer (the parameters are rebuilt on it)."""
        self.config.shard = shard

    @property
    def params(self) -> dict[str, nn.Parameter]:
        """The model's (sharded) parameters of the unit, by name."""
        return self.config.params

    @property
    def places(self) -> dict[str, list[tuple[nn.Module, str]]]:
        """(module, attribute) places where each parameter lives, by parameter name."""
        return self.config.places

    @property
    def rank(self) -> int:
        """This rank in the shard group."""
        return self.config.rank

    @property
    def primitive(self) -> Primitive:
        """Primitive of the gather (and of the reduce-scatter, unless that has its own)."""
        return self.config.primitive

    @property
    def scatter_primitive(self) -> Primitive | None:
        """Primitive of the gradient reduce-scatter (None: :attr:`primitive`)."""
        return self.config.scatter_primitive

    @property
    def replicas(self) -> int:
        """Number of replicas of this shard (HSDP; 1: none)."""
        return self.config.replicas

    @property
    def full(self) -> torch.Tensor | None:
        """The unsharded buffer while the unit is gathered."""
        return self.gather.full

    @property
    def gathers(self) -> int:
        """Gathers issued so far."""
        return self.gather.gathers

    @property
    def anchor(self) -> torch.Tensor:
        """A leaf that requires grad, so the gather is part of the autograd graph."""
        anchor = self._anchor
        if anchor is None or anchor.device != self.shard.device:
            anchor = torch.zeros(0, device=self.shard.device, requires_grad=True)
            self._anchor = anchor
        return anchor

    def gather_master(self) -> torch.Tensor:
        """The unsharded buffer in the master dtype, gathered now
        (:meth:`UnitGather.gather_master`)."""
        return self.gather.gather_master()

    def release(self) -> None:
        """Drop the unsharded buffer, finishing a gather in flight first."""
        self.gather.release()


class Zero3Engine:
    """Installs and removes gathered parameter views around each unit's forward, and
    collects the reduce-scatters of a backward.

    Backward can need a unit's module to hold its gathered parameters again: activation
    checkpointing recomputes a forward inside backward, and where the recomputation runs
    outside the unit's module hooks (torch's ``checkpoint_wrapper``, transformers'
    checkpointed layers) only the engine can put them there. So every unit's forward
    output carries a gradient hook that installs the unit's views when backward reaches
    it; the unit's gradient backward (or the end of backward) puts the sharded
    parameters back. Frozen units have no gradient backward: one gathered again in
    backward is freed once backward has moved on to a unit before it.
    """

    def __init__(
        self,
        units: list[UnitState],
        root: nn.Module,
        reshard_after_forward: bool = True,
        streams: CommStreams | None = None,
    ) -> None:
        self.units = units
        self.root = root
        #: False keeps each unit's unsharded buffer from its forward until its backward
        #: (less communication, more memory).
        self.reshard_after_forward = reshard_after_forward
        self.streams = streams
        self._by_storage: dict[int, UnitState] = {}
        #: The plan's forward order: the prefetch order until the first forward records
        #: its own (``set_planned_order``).
        self.planned_order: list[UnitState] = list(units)
        #: Told the unit names of the first forward, in the order it entered them.
        self.on_order_recorded: Callable[[tuple[str, ...]], None] | None = None
        self._forward_order: list[UnitState] = []
        self._recording = True
        #: id(order list) -> (its length, id(unit) -> first position): see _position
        self._positions: dict[int, tuple[int, dict[int, int]]] = {}
        #: Told when a backward starts and ends (the run log, for tracing).
        self.observer: GatherObserver | None = None
        self._in_backward = False
        self._scattered: list[UnitState] = []
        self._in_flight: list[UnitState] = []
        #: Units whose modules hold gathered views installed during backward.
        self._installed: dict[int, UnitState] = {}
        #: Frozen units gathered during backward (no gradient backward frees them).
        self._held_frozen: dict[int, UnitState] = {}
        #: True while every module holds whole plain parameters (``full_parameters``):
        #: the hooks then leave the modules alone.
        self.summoned = False
        #: True while a whole step holds every unit gathered, with leaf parameters that
        #: sum the step's gradients (:mod:`lamina.memory.whole_step`); ``summoned`` too.
        self.whole_step = False

    @property
    def in_backward(self) -> bool:
        """Whether a backward through the units is running."""
        return self._in_backward

    # -- forward ------------------------------------------------------------------------
    def enter_unit(self, unit: UnitState) -> None:
        """Gather ``unit``, prefetch the next one, install its parameter views. During
        backward (a recomputed forward, or backward reaching the unit) the views are
        built with autograd on, as the forward built them, so that a recomputation saves
        what the forward saved."""
        if self.summoned:
            return
        backward = self._in_backward
        if self._recording and not backward:
            self._forward_order.append(unit)
        with torch.enable_grad() if backward else nullcontext():
            views: tuple[torch.Tensor, ...] = _GatherUnit.apply(unit.anchor, unit, self)  # type: ignore[no-untyped-call]
        if any(v.requires_grad for v in views) and not backward:
            # its backward will run, once per call. A forward recomputed during backward
            # (activation checkpointing) is not a call: autograd only takes the tensors
            # it saves, and no gradient flows back through it
            unit.reduce.open_calls += 1
        self._by_storage[views[0].untyped_storage().data_ptr()] = unit
        if backward:
            self._installed[id(unit)] = unit
            self._hold_if_frozen(unit)
            self._moved_to(unit)
            previous = self._previous_of(unit)
            if previous is not None and previous.config.planned_bwd_gather:
                previous.gather.start_gather("bwd", self.streams)
        else:
            nxt = self._next_after(unit)
            if nxt is not None:
                nxt.gather.start_gather("fwd", self.streams)
        self._install(unit, views)

    def leave_unit(self, unit: UnitState, output: Any = None) -> None:
        """Put the sharded parameters back and (when resharding after forward) drop the
        buffer; autograd keeps tokens, not the buffer, and backward gathers again. A
        training forward's ``output`` gets the gradient hook that reinstalls the unit's
        views when backward reaches it."""
        if self.summoned:
            return
        self.put_back(unit)
        if output is not None and not self._in_backward and torch.is_grad_enabled():
            self.enter_on_backward(output, (unit,))
        if self.reshard_after_forward and not self._kept(unit):
            unit.gather.release()

    def _kept(self, unit: UnitState) -> bool:
        """Whether ``unit`` stays gathered after its forward: a unit the plan keeps for
        backward, when backward may read it (trained parameters or, for a frozen unit, a
        forward with autograd on), and always while backward runs (it is freed when its
        gradient backward, or backward, ends)."""
        if not unit.config.keep_for_backward:
            return False
        if self._in_backward:
            return True
        return unit.reduce.open_calls > 0 or (unit.config.all_frozen and torch.is_grad_enabled())

    def enter_on_backward(self, output: Any, units: tuple[UnitState, ...]) -> None:
        """When backward reaches any tensor of ``output`` that requires grad, install the
        views of ``units`` (once), so that a recomputed forward finds them."""
        tensors = [
            t
            for t in tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
        ]
        if not tensors:
            return
        done = [False]

        def reached(_grad: torch.Tensor) -> None:
            if done[0]:
                return
            done[0] = True
            self._begin_backward()
            for unit in units:
                if id(unit) not in self._installed:
                    self.enter_unit(unit)

        for tensor in tensors:
            tensor.register_hook(reached)  # type: ignore[no-untyped-call]

    def _install(self, unit: UnitState, views: tuple[torch.Tensor, ...]) -> None:
        for p, view in zip(unit.layout.params, views, strict=True):
            for module, attr in unit.places[p.name]:
                module._parameters[attr] = view  # type: ignore[assignment]

    def put_back(self, unit: UnitState) -> None:
        """The modules hold ``unit``'s sharded parameters again."""
        for name, places in unit.places.items():
            for module, attr in places:
                module._parameters[attr] = unit.params[name]
        self._installed.pop(id(unit), None)
        full = unit.gather.full
        if full is not None:
            self._by_storage.pop(full.untyped_storage().data_ptr(), None)

    def uninstall(self, unit: UnitState) -> None:
        """``unit``'s backward is done: views installed for it during backward go."""
        if id(unit) in self._installed:
            self.put_back(unit)

    def drop_stale_prefetches(self) -> None:
        """Before a forward: no unit keeps a buffer gathered before the optimizer step,
        nor calls whose backward never ran."""
        for unit in self.units:
            unit.gather.release()
            unit.reduce.open_calls = 0
            unit.reduce.pending_grads = None
        self._held_frozen.clear()

    def set_planned_order(self, names: Sequence[str]) -> None:
        """Prefetch in the plan's order of unit ``names`` until the first forward records."""
        by_name = {unit.layout.name: unit for unit in self.units}
        self.planned_order = [by_name[name] for name in names]

    def finish_forward(self) -> None:
        """The first forward fixed the unit order used for prefetching; the observer
        (``on_order_recorded``) is told it once."""
        if not self._recording:
            return
        self._recording = False
        if self.on_order_recorded is not None and self._forward_order:
            seen = dict.fromkeys(unit.layout.name for unit in self._forward_order)
            self.on_order_recorded(tuple(seen))

    def _next_after(self, unit: UnitState) -> UnitState | None:
        order = self._forward_order if not self._recording else self.planned_order
        k = self._position(order, unit)
        return order[k + 1] if k is not None and k + 1 < len(order) else None

    def _previous_of(self, unit: UnitState) -> UnitState | None:
        order = self._forward_order or self.planned_order
        k = self._position(order, unit)
        return order[k - 1] if k is not None and k > 0 else None

    def _position(self, order: list[UnitState], unit: UnitState) -> int | None:
        """Where ``unit`` first appears in ``order`` (None: nowhere), by identity, from
        an index kept while ``order`` does not grow (called for every saved tensor that
        backward unpacks)."""
        cached = self._positions.get(id(order))
        if cached is None or cached[0] != len(order):
            index: dict[int, int] = {}
            for k, u in enumerate(order):
                index.setdefault(id(u), k)
            cached = (len(order), index)
            self._positions[id(order)] = cached
        return cached[1].get(id(unit))

    # -- backward -------------------------------------------------------------------------
    def reached(self, unit: UnitState) -> None:
        """Backward reached ``unit``; the end of backward finishes its reduce-scatter."""
        self._scattered.append(unit)
        self._begin_backward()

    def scatter_started(self, unit: UnitState) -> None:
        """``unit`` started its reduce-scatter: finish the ones started before it, which
        had the backward of ``unit`` to overlap with. At most two are in flight, so their
        buffers (the size of the unsharded gradients) do not pile up over a backward."""
        earlier, self._in_flight = self._in_flight, [unit]
        for other in earlier:
            other.reduce.finish_scatter(self.streams)

    def _hold_if_frozen(self, unit: UnitState) -> None:
        """A frozen unit gathered during backward is held until backward moves on."""
        config = unit.config
        if config.all_frozen and not config.keep_for_backward and self.reshard_after_forward:
            self._held_frozen[id(unit)] = unit

    def _moved_to(self, unit: UnitState) -> None:
        """Backward reached ``unit``: frozen units after it in forward order, gathered
        for their part of backward, are done (one needed again is gathered again)."""
        if not self._held_frozen or unit.config.keep_for_backward:
            return  # a unit kept for backward (the root) is read all through it
        order = self._forward_order or self.planned_order
        here = self._position(order, unit)
        if here is None:
            return
        for key, other in list(self._held_frozen.items()):
            there = self._position(order, other)
            if other is not unit and there is not None and there > here:
                del self._held_frozen[key]
                self.uninstall(other)
                other.gather.release()

    def _begin_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            if self.observer is not None:
                self.observer.begin_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._in_backward = False
        if self.observer is not None:
            self.observer.end_backward()
        scattered, self._scattered = self._scattered, []
        done: set[int] = set()
        for unit in scattered:
            if id(unit) not in done:  # a unit called twice is listed twice
                done.add(id(unit))
                unit.reduce.flush_scatter(self.streams)
        self._in_flight = []
        self._held_frozen.clear()
        self._restore_parameters()
        for unit in self.units:  # frozen units kept for backward included
            unit.gather.release()

    def _restore_parameters(self) -> None:
        """Every module holds its sharded parameters again: a forward recomputed during
        backward (activation checkpointing) may stop early, before a unit's forward hook
        put them back."""
        for unit in self.units:
            for name, places in unit.places.items():
                for module, attr in places:
                    if module._parameters[attr] is not unit.params[name]:
                        module._parameters[attr] = unit.params[name]
        self._by_storage.clear()
        self._installed.clear()

    # -- saved tensors --------------------------------------------------------------------
    @contextmanager
    def saved_views_as_tokens(self) -> Iterator[None]:
        """Within the block, autograd saves tokens instead of views of unit buffers."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> Any:
        unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return _Token(
            unit,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
            tensor.requires_grad,
        )

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Token):
            return packed  # type: ignore[no-any-return]
        self._begin_backward()
        unit = packed.unit
        self._moved_to(unit)
        full = unit.gather.wait_gather("bwd", self.streams)
        self._hold_if_frozen(unit)
        previous = self._previous_of(unit)
        if previous is not None and previous.config.planned_bwd_gather:
            previous.gather.start_gather("bwd", self.streams)  # backward runs the units in reverse
        view = full.as_strided(packed.shape, packed.stride, packed.offset)
        return view


class _GatherUnit(torch.autograd.Function):
    """anchor -> the unit's parameters as views of its unsharded buffer (one output
    each); backward: start the unit's reduce-scatter of their gradients."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, unit: UnitState, engine: Zero3Engine
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit, ctx.engine = unit, engine
        ctx.set_materialize_grads(False)  # None: autograd did not reach that parameter
        full = unit.gather.wait_gather("bwd" if engine.in_backward else "fwd", engine.streams)
        views = tuple(unit.layout.views(full).values())
        frozen = [
            v
            for v, p in zip(views, unit.layout.params, strict=True)
            if p.name in unit.config.frozen
        ]
        if frozen:  # no gradient is computed for a frozen parameter, as without sharding
            ctx.mark_non_differentiable(*frozen)
        return views

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:  # type: ignore[override]
        unit: UnitState = ctx.unit
        engine: Zero3Engine = ctx.engine
        reduce = unit.reduce
        scatter_in = reduce.add_gradients(grads)
        reduce.open_calls = max(0, reduce.open_calls - 1)
        engine.reached(unit)
        if reduce.open_calls > 0:  # called again in the forward: one reduce-scatter, at the end
            reduce.pending_grads = scatter_in
            return None, None, None
        reduce.start_scatter(scatter_in, engine.streams)
        engine.uninstall(unit)
        unit.gather.release()
        engine.scatter_started(unit)
        return None, None, None


@dataclass(frozen=True)
class _Token:
    unit: UnitState
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
