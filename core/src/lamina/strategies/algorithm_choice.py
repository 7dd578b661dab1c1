"""The group -> cost model -> algorithm choice step every strategy takes, once.

A strategy hands over the collectives it will issue (a key and the bytes of each: DP's
buckets, ZeRO-3's units) and gets back the algorithm of each, from the cost model of its
group's links. The plan records each choice (:mod:`lamina.strategies.algorithm_nodes`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

from lamina.comm.cost import (
    AlgorithmChoice,
    CostModel,
    choose_algorithm,
    choose_sharded_algorithm,
    unavailable_algorithms,
)
from lamina.device.topology import Topology

K = TypeVar("K", bound=Hashable)
#: Per collective: None to leave it unchosen (it runs a form of its own, e.g. a two-phase
#: codec's sum), else the algorithms it cannot run, with why (``unavailable`` extended).
Exclusions = Callable[[K, dict[str, str]], dict[str, str] | None]


def group_cost_model(topology: Topology, ranks: tuple[int, ...]) -> CostModel | None:
    """The cost model of the links between ``ranks`` (None for one rank: no collective)."""
    return CostModel.from_topology(topology, ranks) if len(ranks) > 1 else None


def choose_algorithms(
    model: CostModel | None,
    nbytes: Mapping[K, int],
    requested: str,
    *,
    pg_backend: str,
    whole_job: bool,
    sharded: bool = False,
    exclusions: Exclusions[K] | None = None,
) -> dict[K, AlgorithmChoice]:
    """The algorithm of each collective in ``nbytes`` (its key -> the bytes it moves: an
    all-reduce's buffer, or a sharded unit's whole buffer with ``sharded``), ``requested``
    ("auto": the model's pick) among those the group can run on ``pg_backend``; the
    hierarchical forms need the group to be the whole job in rank order (``whole_job``).
    Nothing without a model (one rank)."""
    if model is None:
        return {}
    unavailable = unavailable_algorithms(model.layout, pg_backend, whole_job)
    choose = choose_sharded_algorithm if sharded else choose_algorithm
    choices: dict[K, AlgorithmChoice] = {}
    for key, size in nbytes.items():
        excluded = exclusions(key, unavailable) if exclusions is not None else unavailable
        if excluded is not None:
            choices[key] = choose(model, size, requested, excluded)
    return choices
