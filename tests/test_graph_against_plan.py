"""The compiled step's check of a captured graph's collectives against its plan's calls
(``CheckedBackend``, ``mismatch``), on one gloo rank: a step holding two DP buckets as
their plan runs them (one hierarchical in two chunks, :mod:`graph_algorithms`; one flat
all-reduce) is captured by ``torch.compile``; the graph as captured passes, the same
graph with one collective taken out is refused, naming the plan's call it misses."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from lamina.strategies.compiled.graph_algorithms import (
    hierarchical_all_reduce,
    hierarchical_calls,
)
from lamina.strategies.compiled.graph_collectives import (
    CheckedBackend,
    PlannedCall,
    graph_collectives,
)

pytestmark = pytest.mark.portable

#: The hierarchical bucket: its elements and chunks (one rank per host here).
HIERARCHICAL, CHUNKS = 10, 2
#: The flat bucket's elements.
FLAT = 7


def _step(hierarchical: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The two buckets' sums, as a compiled DP step issues them."""
    world = dist.group.WORLD
    assert world is not None
    first = hierarchical_all_reduce(hierarchical, None, None, 1, True, CHUNKS)
    second = funcol.all_reduce(flat, "sum", world)
    return torch.cat([first, second]) * 2


def _planned() -> list[PlannedCall]:
    """The plan's calls of the two buckets, in plan order."""
    return [
        *hierarchical_calls("bucket0", HIERARCHICAL, 1, True, CHUNKS),
        PlannedCall("bucket1", "all_reduce", FLAT),
    ]


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Kept:
    """An inner backend that keeps each graph it compiles (and runs it as it is)."""

    def __init__(self) -> None:
        self.graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs.append((gm, example_inputs))
        return gm.forward


def _captured() -> tuple[CheckedBackend, _Kept, torch.Tensor]:
    """The checked backend, the graphs it let through, and the compiled step's result."""
    kept = _Kept()
    checked = CheckedBackend(kept, _planned, None)
    torch._dynamo.reset()
    compiled = torch.compile(_step, backend=checked, fullgraph=True)
    out = compiled(torch.arange(float(HIERARCHICAL)), torch.ones(FLAT))
    return checked, kept, out


def _without_collective(gm: torch.fx.GraphModule, k: int) -> torch.fx.GraphModule:
    """A copy of ``gm`` with its ``k``-th functional collective (and its wait) taken out:
    the collective's readers read its input instead."""
    gm = copy.deepcopy(gm)
    nodes = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and "_c10d_functional" in str(n.target)
        if "wait_tensor" not in str(n.target)
    ]
    collective = nodes[k]
    (wait,) = collective.users
    wait.replace_all_uses_with(collective.args[0])
    gm.graph.erase_node(wait)
    gm.graph.erase_node(collective)
    gm.graph.lint()
    gm.recompile()
    return gm


def _refusal(checked: CheckedBackend, gm: torch.fx.GraphModule, inputs: list[Any]) -> str:
    try:
        checked(gm, inputs)
    except RuntimeError as exc:
        return str(exc)
    return "the check let the graph through"


def test_a_captured_graph_issuing_the_plans_calls_passes_the_check(one_rank: None) -> None:
    """The graph torch.compile captures is checked, found to follow the plan and run."""
    checked, kept, out = _captured()
    expected = torch.cat([torch.arange(float(HIERARCHICAL)), torch.ones(FLAT)]) * 2
    assert torch.equal(out, expected)
    assert len(kept.graphs) == 1 and checked.entered == 1
    lines = [c.line() for c in checked.graphs[0]]
    chunk = ["reduce_scatter 5", "all_reduce 5", "all_gather 5"]
    assert lines == [f"{c} x float32 over 1 ranks" for c in [*chunk, *chunk, "all_reduce 7"]]


@pytest.mark.parametrize(
    ("removed", "refused"),
    [
        (
            1,  # the first chunk's all-reduce across the hosts
            "collective 1 of the captured graph is all_gather of 5 elements, "
            "the plan's node bucket0 issues all_reduce of 5",
        ),
        (6, "the captured graph issues 6 collectives, the plan 7"),  # bucket1's all-reduce
    ],
    ids=["a hierarchical phase", "the last bucket"],
)
def test_a_graph_missing_one_of_the_plans_collectives_is_refused(
    one_rank: None, removed: int, refused: str
) -> None:
    """The captured graph less one collective is refused before it compiles, naming the
    plan's call it misses (or, the last one missing, the counts)."""
    checked, kept, _ = _captured()
    gm, inputs = kept.graphs[0]
    short = _without_collective(gm, removed)
    assert len(graph_collectives(short)) == len(graph_collectives(gm)) - 1
    message = _refusal(checked, short, inputs)
    assert message == f"the captured step does not follow its plan: {refused}"
    assert len(kept.graphs) == 1 and len(checked.graphs) == 1  # nothing more compiled
