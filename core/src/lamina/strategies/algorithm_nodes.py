"""How a plan node records the collective algorithm the cost model chose for it (DP
buckets, ZeRO-3 gathers and reduce-scatters): its typed fact and its fallback edge."""

from __future__ import annotations

from lamina.comm.cost import AlgorithmChoice
from lamina.runtime.nodes import AlgorithmFact
from lamina.runtime.plan import Fallback


def algorithm_fact(choice: AlgorithmChoice | None) -> AlgorithmFact | None:
    """The plan's record of ``choice``: the algorithm, its chunk count and every runnable
    algorithm's predicted seconds (None without a choice: flat)."""
    if choice is None:
        return None
    predictions = tuple((name, float(seconds)) for name, seconds in choice.predictions)
    return AlgorithmFact(choice.algorithm, choice.chunks, predictions)


def algorithm_fallback(node_id: str, choice: AlgorithmChoice) -> Fallback:
    """The node's fallback edge from the chosen (or requested) algorithm to ``flat``,
    taken when the requested algorithm cannot run on this job."""
    primary = choice.requested if choice.fallback_reason else choice.algorithm
    return Fallback(
        node_id,
        f"algorithm:{primary}",
        "algorithm:flat",
        "the algorithm's process groups cannot be formed on this job",
        taken=bool(choice.fallback_reason),
        reason=choice.fallback_reason,
    )


def records_algorithm(choice: AlgorithmChoice | None) -> bool:
    """Whether a node with ``choice`` declares the fallback edge (it runs something
    other than flat, or flat replaced what was asked for)."""
    return choice is not None and (choice.algorithm != "flat" or bool(choice.fallback_reason))
