"""A step priced from its plan's nodes (:func:`lamina.simulate.step.price_step`): the two
streams, a DP bucket ready when backward has produced its share, collectives inside a
layer holding the compute up, the overlap share, and every collective of the plan
priced once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lamina.runtime import ExecutionPlan
from lamina.runtime.nodes import Collective, Compute
from lamina.runtime.plan import CollectiveSpec, PlanNode
from lamina.simulate.step import price_step

COMPUTE = {"forward": 10.0, "backward": 20.0, "optimizer": 5.0}


@dataclass
class Prices:
    """Compute by kind; a collective's seconds its element count over 25."""

    overlap: float = 1.0
    skew: float = 0.0

    def compute(self, node: PlanNode) -> float:
        return COMPUTE[node.kind]

    def collective(self, node: PlanNode, op: str) -> float:
        assert node.collective is not None
        return node.collective.numel / 25

    def transfer(self, nbytes: int, axis: str) -> float:
        return 0.0


def _collective(node_id: str, phase: str, numel: int, **facts: object) -> PlanNode:
    spec = CollectiveSpec("all_reduce", "float32", numel, 4, (0, 1), axis="dp")
    return PlanNode(node_id, "collective", phase, node_id, Collective(**facts), spec)  # type: ignore[arg-type]


def _dp_plan(*extra: PlanNode) -> ExecutionPlan:
    nodes = (
        PlanNode("forward", "forward", "forward", "forward", Compute()),
        PlanNode("backward", "backward", "backward", "backward", Compute()),
        _collective("bucket0", "backward", 100, purpose="gradient", bucket=0),
        _collective("bucket1", "backward", 300, purpose="gradient", bucket=1),
        PlanNode("optimizer", "optimizer", "step", "optimizer", Compute()),
        *extra,
    )
    edges = (
        ("forward", "backward"),
        ("backward", "bucket0"),
        ("backward", "bucket1"),
        ("bucket0", "optimizer"),
        ("bucket1", "optimizer"),
        *(("forward", n.id) for n in extra),
    )
    return ExecutionPlan("dp", 2, "gloo", nodes, edges)


def test_a_bucket_is_reduced_once_backward_has_produced_its_share() -> None:
    step = price_step(_dp_plan(), Prices())
    # bucket0 (a quarter of the bytes) ready at 10 + 20/4 = 15, reduced by 19, hidden;
    # bucket1 ready when backward ends (30), reduced 30-42; the optimizer 42-47
    assert step.step_s == pytest.approx(47.0)
    assert step.parts["communication"] == pytest.approx(16.0)
    assert step.parts["exposed"] == pytest.approx(12.0)
    assert [(c.node, c.blocking) for c in step.collectives] == [
        ("bucket0", False),
        ("bucket1", False),
    ]


def test_without_overlap_compute_and_communication_add_up() -> None:
    assert price_step(_dp_plan(), Prices(overlap=0.0)).step_s == pytest.approx(51.0)
    assert price_step(_dp_plan(), Prices(overlap=0.5)).step_s == pytest.approx(49.0)


def test_a_collective_inside_a_layer_holds_the_compute_up_with_the_skew() -> None:
    inside = _collective("tp.fwd", "forward", 75, purpose="activation", layer="blocks.0")
    step = price_step(_dp_plan(inside), Prices(skew=0.5))
    # forward 10 + 3 + 0.5 = 13.5; backward 13.5-33.5, bucket1 33.5-45.5, optimizer 50.5
    assert step.step_s == pytest.approx(50.5)
    assert step.parts["blocking collectives"] == pytest.approx(3.5)
    assert {c.node: c.blocking for c in step.collectives}["tp.fwd"] is True


def test_setup_collectives_are_not_part_of_a_step() -> None:
    setup = PlanNode(
        "setup.broadcast",
        "collective",
        "setup",
        "setup",
        Collective(purpose="broadcast", source=0),
        CollectiveSpec("broadcast", "float32", 10_000, 4, (0, 1), axis="dp"),
    )
    plan = _dp_plan()
    with_setup = ExecutionPlan("dp", 2, "gloo", (setup, *plan.nodes), plan.edges)
    priced = price_step(with_setup, Prices())
    assert priced.step_s == pytest.approx(47.0)
    assert "setup.broadcast" not in {c.node for c in priced.collectives}
