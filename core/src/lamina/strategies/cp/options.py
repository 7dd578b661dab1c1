"""Options of context parallelism (``lamina.distribute(model, "cp", **options)``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lamina.errors import ConfigError
from lamina.strategies.contract import StrategyOptions

#: What ``attention=`` takes: one for every attention call, or ``auto`` (priced per call).
ALGORITHM_CHOICES = ("auto", "all_gather", "pass_kv", "all_to_all")


@dataclass(frozen=True)
class ContextParallelOptions(StrategyOptions):
    """``example_inputs`` / ``example_kwargs``: a batch of the training shape (whole
    sequences); ``attention``: the attention algorithm (``auto``: the cheapest per call);
    ``load_balance``: each rank holds a head and a tail chunk (even causal work);
    ``seq_dim``: the inputs' and outputs' sequence dim."""

    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: Mapping[str, Any] | None = None
    attention: str = "auto"
    load_balance: bool = True
    seq_dim: int = 1
    #: Whether cp averages the gradients itself after backward (alone); composition sets
    #: it False when a sharder spanning the cp axis syncs them.
    sync_gradients: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ALGORITHM_CHOICES:
            raise ConfigError(
                f"strategy 'cp' has no attention algorithm {self.attention!r}; choose one of "
                f"{', '.join(ALGORITHM_CHOICES)}"
            )
        if not isinstance(self.seq_dim, int) or self.seq_dim < 0:
            raise ConfigError(
                f"strategy 'cp': seq_dim must be a dim index >= 0, got {self.seq_dim!r}"
            )
