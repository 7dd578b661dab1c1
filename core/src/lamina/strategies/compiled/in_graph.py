"""What a composed strategy whose collectives run inside the model's forward gives the
compiled step of the strategy that shards the model: :class:`InGraphCollectives`.

Tensor parallelism issues its activation collectives from the model's own layers, so
they are captured with the forward and its backward (each as a traceable autograd
function). The compiled step of the sharding strategy (``zero3``, ``hsdp``) holds the
rest of the step; from this it learns which calls the captured forward and backward
issue (checked against the graph), what to record in the strategy's run log each
replay, which gradients to sum over its group after the backward, and which
parameters are split across that group (for the gradient norm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch.distributed as dist

from lamina.strategies.compiled.graph_collectives import PlannedCall


class InGraphCollectives(Protocol):
    """A strategy's collectives inside the model's forward, seen by a compiled step."""

    #: The strategy's name (``tp``).
    name: str

    def keep_order(self) -> None:
        """An eager training step just ran (before the first capture): keep the order of
        what it issued, which the other methods read."""
        ...

    def planned_calls(self) -> Sequence[PlannedCall]:
        """The calls the captured forward and backward issue, in the order they run."""
        ...

    def summed_gradients(self) -> Sequence[tuple[str, tuple[str, ...]]]:
        """Gradients the graph sums over :meth:`group` after the backward, one all-reduce
        per plan node: (node, the parameters' names), in the eager step's order."""
        ...

    def record_replay(self) -> None:
        """One replay's entries in the strategy's run log: its plan nodes issued."""
        ...

    def split_parameters(self) -> frozenset[str]:
        """The parameters each rank holds a slice of (their gradient norm is summed over
        :meth:`group`; every other one is whole on each of its ranks)."""
        ...

    def group(self) -> tuple[dist.ProcessGroup, tuple[int, ...], str]:
        """The strategy's group: the process group, its global ranks and its mesh axis."""
        ...
