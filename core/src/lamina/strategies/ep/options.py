"""Options of expert parallelism (``lamina.distribute(model, ["ep", "zero3"], **options)``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lamina.errors import ConfigError
from lamina.strategies.contract import StrategyOptions


@dataclass(frozen=True)
class ExpertParallelOptions(StrategyOptions):
    """``example_inputs`` / ``example_kwargs``: a batch of the training shape (one forward
    finds the MoE layers); ``dispatcher``: the token dispatcher by name
    (``lamina_register_dispatchers`` adds more); ``global_aux_loss``: the router's
    load-balancing loss computed over the global batch, as one process computes it."""

    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: Mapping[str, Any] | None = None
    dispatcher: str = "all_to_all"
    global_aux_loss: bool = True
    #: The mesh axes batches differ over, the whole job's (composition fills them in:
    #: ep's own axes and the sharder's); the load-balancing loss is summed over them.
    data_axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dispatcher, str) or not self.dispatcher:
            raise ConfigError(
                f"strategy 'ep': dispatcher must be a dispatcher's name, got {self.dispatcher!r}; "
                "use dispatcher='all_to_all'"
            )
        if self.data_axes is not None and (
            isinstance(self.data_axes, str) or not all(isinstance(a, str) for a in self.data_axes)
        ):
            raise ConfigError(
                f"strategy 'ep': data_axes must be a tuple of mesh axis names, got "
                f"{self.data_axes!r}"
            )
