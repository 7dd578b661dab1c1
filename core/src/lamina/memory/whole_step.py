"""Every unit gathered once for a whole step: :class:`WholeStepGather`.

A step made of several forwards and backwards that interleave (a pipeline schedule's
microbatches: 1F1B runs the next microbatch's forward before the last one's backward)
cannot gather and reduce-scatter around each forward and backward as the engine's hooks
do. Here, as FSDP2 does under a pipeline (no resharding after forward, gradient sync on
the last microbatch only): :meth:`~WholeStepGather.begin` gathers every unit and gives
each module whole leaf parameters, views of the unsharded buffers, so the microbatches'
backwards sum their gradients into them; :meth:`~WholeStepGather.finish` reduce-scatters
those sums into the sharded parameters' ``.grad`` (averaged over the shard group, and
across replicas under HSDP, exactly as a unit's backward would) and
:meth:`~WholeStepGather.end` puts the sharded parameters back. The engine's hooks stay
inert in between.
"""

from __future__ import annotations

from torch import nn

from lamina.errors import ConfigError
from lamina.memory.engine import UnitState, Zero3Engine


class WholeStepGather:
    """Gathers ``engine``'s units for a whole step and scatters their gradients after."""

    def __init__(self, engine: Zero3Engine) -> None:
        self.engine = engine
        #: id(unit) -> the whole leaf parameters installed for the step, by name.
        self._leaves: dict[int, dict[str, nn.Parameter]] = {}

    @property
    def open(self) -> bool:
        """Whether a step holds the whole parameters now."""
        return self.engine.whole_step

    def begin(self, train: bool = True) -> None:
        """Gather every unit (all gathers started first, then waited for in order) and
        install whole leaf parameters; ``train=False`` installs them without autograd."""
        engine = self.engine
        if engine.summoned:
            raise ConfigError(
                "the model's whole parameters are already held (full_parameters() or a "
                "step in progress); leave that block before the step"
            )
        engine.drop_stale_prefetches()
        if train and engine.observer is not None:
            engine.observer.begin_step()
        for unit in engine.units:
            unit.gather.start_gather("fwd", engine.streams)
        engine.summoned = engine.whole_step = True
        for unit in engine.units:
            full = unit.gather.wait_gather("fwd", engine.streams)
            leaves = {
                name: nn.Parameter(
                    view.detach(), requires_grad=train and name not in unit.config.frozen
                )
                for name, view in unit.layout.views(full).items()
            }
            self._leaves[id(unit)] = leaves
            for name, places in unit.places.items():
                for module, attr in places:
                    module._parameters[attr] = leaves[name]

    def finish(self) -> None:
        """Reduce-scatter each unit's summed gradients into its sharded parameters'
        ``.grad`` (the last units first, as a backward would; two in flight at most);
        :meth:`end` then puts the sharded parameters back."""
        engine = self.engine
        in_flight: UnitState | None = None
        for unit in reversed(engine.units):
            if unit.config.all_frozen:
                continue  # no gradient on any rank: no collective
            leaves = self._leaves[id(unit)]
            grads = tuple(leaves[p.name].grad for p in unit.layout.params)
            unit.reduce.start_scatter(unit.reduce.add_gradients(grads), engine.streams)
            if in_flight is not None:
                in_flight.reduce.finish_scatter(engine.streams)
            in_flight = unit
        if in_flight is not None:
            in_flight.reduce.finish_scatter(engine.streams)
        for unit in engine.units:  # HSDP: the replicas' all-reduces still in flight
            unit.reduce.finish_replicate()

    def end(self) -> None:
        """The sharded parameters back and the unsharded buffers dropped, without any
        collective (after :meth:`finish`, after an evaluation, or when a step raised)."""
        engine = self.engine
        for unit in engine.units:
            engine.put_back(unit)
            unit.gather.release()
        self._leaves.clear()
        engine.summoned = engine.whole_step = False
