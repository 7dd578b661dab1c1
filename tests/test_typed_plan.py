"""The execution plan is typed: each node kind holds a dataclass of its facts, JSON reads
back into the same plan, nothing reads a fact back from a label or a string.

The plans here are the real builders' (DP with algorithms and fp8, HSDP with fp8 on the
replica all-reduce) from real captures and layouts; the pipeline nodes (send/recv, stage
and microbatch) are declared for the pipeline work and round-trip like the others.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lamina
from lamina.comm.buckets import ParamSpec, plan_buckets
from lamina.comm.cost import AlgorithmChoice
from lamina.errors import ConfigError
from lamina.graph import CAPTURE_METHODS, capture
from lamina.memory import UnitLayout, build_layout, group_units
from lamina.runtime import (
    AlgorithmFact,
    CodecFact,
    Collective,
    CollectiveSpec,
    Compute,
    ExecutionPlan,
    Free,
    Gather,
    PlanNode,
    Transfer,
)
from lamina.runtime.primitives import choose_primitive
from lamina.simulate import cluster_from_dict, predict
from lamina.strategies.codec_registry import resolve_codec
from lamina.strategies.dp.plan import DPPlanInputs, bucket_node, bucket_plan_of, build_dp_plan
from lamina.strategies.zero3.engine_settings import plan_layout
from lamina.strategies.zero3.plan import PlanGroups, Zero3PlanInputs, build_zero3_plan, unit_fact

pytestmark = pytest.mark.portable

SOURCES = Path(__file__).resolve().parents[1] / "core" / "src" / "lamina"
CLUSTER = {
    "name": "4 x 8",
    "hosts": 4,
    "devices_per_host": 8,
    "device_memory_gib": 80,
    "intra": {"kind": "nvlink", "bandwidth_gbps": 450, "latency_us": 3},
    "inter": {"kind": "ib", "bandwidth_gbit": 400, "latency_us": 5, "nics_per_host": 8},
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4))


def _dp_plan(codec: str | None = "fp8") -> ExecutionPlan:
    return build_dp_plan(_dp_inputs(codec))


def _dp_inputs(codec: str | None = "fp8") -> DPPlanInputs:
    model = _mlp()
    model.register_parameter("unused", nn.Parameter(torch.zeros(3, 2)))  # not in the forward
    graph = capture(model, (torch.randn(2, 16),))
    named = dict(model.named_parameters())
    specs = [ParamSpec(n, tuple(named[n].shape), named[n].dtype) for n in graph.param_names]
    buckets = plan_buckets(
        specs,
        graph.grad_ready_order(),
        cap_bytes=4096,
        first_bucket_bytes=4096,
        unused=graph.unused,
    )
    choice = AlgorithmChoice(
        "pipelined", 4, (("flat", 2e-3), ("hierarchical", 1.5e-3), ("pipelined", 1e-3))
    )
    return DPPlanInputs(
        graph=graph,
        buckets=buckets,
        group=(0, 1, 2, 3),
        backend="cpu",
        pg_backend="gloo",
        setup_state=[("float32", sum(p.numel() for p in model.parameters()))],
        step_buffers=[],
        codec=resolve_codec(codec),
        codec_checks={"float32": ""},
        algorithms={0: choice},
        ranks_per_host=2,
    )


def _hsdp_plan(codec: str | None = "fp8") -> ExecutionPlan:
    model = _mlp()
    layout = build_layout(model, 2, units=group_units(model, min_unit_numel=1))
    names = [u.name for u in layout.units]
    fp8 = resolve_codec(codec)
    return build_zero3_plan(
        Zero3PlanInputs(
            layout=layout,
            forward_order=names,
            whole_forward=frozenset(names[:1]),
            groups=PlanGroups(
                shard=(0, 1),
                shard_axis="intra",
                replicate=(0, 2),
                replicate_axis="inter",
                everyone=(0, 1, 2, 3),
                everyone_axis="inter+intra",
            ),
            backend="cpu",
            pg_backend="gloo",
            gather=choose_primitive("all_gather", "gloo", mode="native"),
            scatter=choose_primitive("reduce_scatter", "gloo", mode="native"),
            setup_state=[("float32", 10)],
            strategy="hsdp",
            kept_for_backward=frozenset(names[:1]),
            codec=fp8,  # type: ignore[arg-type]
        )
    )


def _pipeline_plan() -> ExecutionPlan:
    """Two stages' nodes as the pipeline work will declare them (stage 0 on rank 0)."""
    activation = Transfer(1, 0, 0, "activation", "float32", 4096, 4)
    nodes = (
        PlanNode("s0.mb0.forward", "forward", "forward", "f", Compute(stage=0, microbatch=0)),
        PlanNode("s0.mb0.send", "send", "forward", "send", activation),
        PlanNode(
            "s0.mb0.recv.grad",
            "recv",
            "backward",
            "recv",
            dataclasses.replace(activation, what="gradient"),
        ),
        PlanNode("s0.mb0.backward", "backward", "backward", "b", Compute(stage=0, microbatch=0)),
        PlanNode("optimizer", "optimizer", "step", "step", Compute(stage=0)),
    )
    edges = tuple((a.id, b.id) for a, b in itertools.pairwise(nodes))
    return ExecutionPlan("pp", 2, "cpu", nodes, edges)


def _round_trip(plan: ExecutionPlan) -> ExecutionPlan:
    return ExecutionPlan.from_dict(json.loads(plan.to_json()))


@pytest.mark.parametrize("build", [_dp_plan, _hsdp_plan, _pipeline_plan])
def test_the_json_reads_back_into_the_same_typed_plan(build: object) -> None:
    plan = build()  # type: ignore[operator]
    again = _round_trip(plan)
    assert again == plan and again.fingerprint == plan.fingerprint
    for ours, theirs in zip(plan.nodes, again.nodes, strict=True):
        assert type(theirs.detail) is type(ours.detail) and theirs.detail == ours.detail


def test_dp_buckets_carry_their_algorithm_and_codec_as_types() -> None:
    plan = _dp_plan()
    first = plan.node(bucket_node(0))
    assert first.algorithm == AlgorithmFact(
        "pipelined", 4, (("flat", 2e-3), ("hierarchical", 1.5e-3), ("pipelined", 1e-3))
    )
    assert first.algorithm.describe() == "pipelined x4 chunks"
    assert first.codec is not None and (first.codec.name, first.codec.scope) == ("fp8", "all")
    assert first.codec.error_feedback and first.codec.residual_bytes > 0
    detail = first.facts(Collective)
    assert detail is not None and detail.purpose == "gradient" and detail.bucket == 0
    forward = plan.node("forward").facts(Compute)
    assert forward is not None and forward.mode == "eager" and forward.capture in CAPTURE_METHODS
    plain = _dp_plan(codec=None).node(bucket_node(1))
    assert plain.codec is None and plain.algorithm is None  # flat, uncompressed


def test_the_reducer_runs_the_buckets_the_printed_plan_holds() -> None:
    inputs = _dp_inputs()
    planned = inputs.buckets
    assert planned.excluded == ("unused",) and len(planned.buckets) > 1
    plan = build_dp_plan(inputs)
    # read from the plan's typed nodes, also from its JSON: the same buckets and slots
    assert bucket_plan_of(plan, planned) == planned
    assert bucket_plan_of(_round_trip(plan), planned) == planned
    # a plan whose first bucket holds other slots runs those, not the planner's
    first = plan.node(bucket_node(0))
    detail = first.facts(Collective)
    assert detail is not None and len(detail.slots) > 1
    swapped = dataclasses.replace(detail, slots=(detail.slots[-1], *detail.slots[:-1]))
    edited = plan.with_nodes(
        tuple(dataclasses.replace(n, detail=swapped) if n is first else n for n in plan.nodes)
    )
    run = bucket_plan_of(edited, planned).buckets[0]
    assert run.param_names[0] == detail.slots[-1].name != planned.buckets[0].param_names[0]


def test_the_zero3_engine_builds_the_units_the_printed_plan_holds() -> None:
    plan = _hsdp_plan(codec=None)
    model = _mlp()
    layout = build_layout(model, 2, units=group_units(model, min_unit_numel=1))
    assert len(layout.units) > 1
    assert plan_layout(plan, layout) == layout
    assert plan_layout(_round_trip(plan), layout) == layout
    # a unit edited in the plan no longer adds up to the layout it was planned from
    node = next(n for n in plan.nodes if (g := n.facts(Gather)) and g.layout and g.layout.params)
    gather = node.facts(Gather)
    assert gather is not None and gather.layout is not None and len(gather.layout.params) > 1
    fact = gather.layout
    wider = [(p.name, (p.shape[0] + 1, *p.shape[1:])) for p in fact.params]
    unit = UnitLayout.pack(fact.index, gather.unit, torch.float32, wider, 2)
    for changed, message in (
        (unit_fact(unit), "do not match the shard layout it was planned from"),
        (dataclasses.replace(fact, params=unit_fact(unit).params[:1] + fact.params[1:]), "pack"),
    ):
        detail = dataclasses.replace(gather, layout=changed)
        edited = plan.with_nodes(
            tuple(dataclasses.replace(n, detail=detail) if n is node else n for n in plan.nodes)
        )
        with pytest.raises(ConfigError, match=message):
            plan_layout(edited, layout)


class _BlocksCalledBackwards(nn.Module):
    """Three blocks the forward calls last to first: not the order the layout lists."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = block(x)
        return x


def _forward_units(plan: ExecutionPlan) -> list[str]:
    return [
        g.unit for n in plan.nodes if (g := n.facts(Gather)) is not None and g.span != "backward"
    ]


def test_the_first_forward_records_its_unit_order_into_the_plan_the_simulator_reads() -> None:
    lamina.init()
    model: Any = lamina.distribute(_BlocksCalledBackwards(), "zero3", min_unit_numel=1)
    planned = model.execution_plan
    assert _forward_units(planned) == ["blocks.0", "blocks.1", "blocks.2"]
    assert dict(planned.meta)["forward_order"] == "planned"
    assert model.lamina_engine.planned_order == model.lamina_engine.units  # the plan's
    model(torch.randn(2, 8)).sum().backward()
    recorded = model.execution_plan
    assert _forward_units(recorded) == ["blocks.2", "blocks.1", "blocks.0"]
    assert dict(recorded.meta)["forward_order"] == "recorded at step 1"
    assert model.run_log.plan is recorded  # what the run log and lamina plan show
    assert {n.id for n in recorded.nodes} == {n.id for n in planned.nodes}
    cluster = cluster_from_dict(CLUSTER, "cluster.json")
    gathers = [c.node for c in predict(recorded, cluster).per_step if c.op == "all_gather"]
    assert gathers[0] == "blocks.2.gather.fwd"
    model(torch.randn(2, 8)).sum().backward()  # recorded once: the plan stays
    assert model.execution_plan is recorded


def test_hsdp_nodes_name_their_unit_span_and_replica_codec() -> None:
    plan = _hsdp_plan()
    gathers = [g for n in plan.nodes if (g := n.facts(Gather)) is not None]
    assert {g.span for g in gathers} == {"whole_forward", "forward", "backward"}
    assert all(g.primitive == "all_gather" for g in gathers)
    replicas = [
        n for n in plan.collectives() if (c := n.facts(Collective)) and c.purpose == "replicate"
    ]
    codecs = {(n.codec.name, n.codec.scope) for n in replicas if n.codec is not None}
    assert replicas and codecs == {("fp8", "replicas")}
    assert all(n.codec is None for n in plan.collectives() if n.scatters_gradient)
    assert {n.unit for n in plan.nodes if n.kind == "free"} <= {g.unit for g in gathers}
    assert plan.replicate_axis == "inter"


def test_a_changed_label_does_not_move_the_prediction() -> None:
    cluster = cluster_from_dict(CLUSTER, "cluster.json")
    for plan in (_hsdp_plan(codec=None), _dp_plan(codec=None)):
        relabelled = plan.with_nodes(
            tuple(dataclasses.replace(n, label="renamed") for n in plan.nodes)
        )
        assert [n.label for n in relabelled.nodes] == ["renamed"] * len(plan.nodes)
        assert predict(relabelled, cluster).to_json() == predict(plan, cluster).to_json()
    # and the facts do move it: a unit gathered for the whole forward holds more memory
    plan = _hsdp_plan(codec=None)
    spans = tuple(
        dataclasses.replace(n, detail=dataclasses.replace(n.detail, span="whole_forward"))
        if isinstance(n.detail, Gather) and n.detail.span == "forward"
        else n
        for n in plan.nodes
    )
    before = predict(plan, cluster).memory.gathered_bytes
    assert predict(plan.with_nodes(spans), cluster).memory.gathered_bytes > before


def test_a_node_must_hold_its_kinds_facts() -> None:
    spec = CollectiveSpec("all_reduce", "float32", 8, 4, (0, 1))
    with pytest.raises(ConfigError, match=r"'b' \(collective\) holds a Compute; .* Collective"):
        PlanNode("b", "collective", "backward", "b", Compute(), spec)
    with pytest.raises(ConfigError, match=r"'g' \(gather\) needs a collective"):
        PlanNode("g", "gather", "forward", "g", Gather("u", "forward"))
    with pytest.raises(ConfigError, match=r"'f' \(free\) has no use for a collective"):
        PlanNode("f", "free", "forward", "f", Free("u"), spec)
    with pytest.raises(ConfigError, match="unknown kind 'teleport'; use one of forward"):
        PlanNode("t", "teleport", "forward", "t", Compute())
    assert PlanNode("c", "collective", "backward", "c", Collective("gradient"), spec).codec is None
    assert CodecFact("int8").scope == "all"


def test_malformed_details_in_json_name_the_node_and_field() -> None:
    data = json.loads(_hsdp_plan().to_json())
    node = next(n for n in data["nodes"] if n["kind"] == "gather")
    node["detail"]["span"] = "forever"
    said = re.escape(f"node '{node['id']}': span 'forever' is not one of")
    with pytest.raises(ConfigError, match=said):
        ExecutionPlan.from_dict(data)
    data = json.loads(_dp_plan().to_json())
    del data["nodes"][0]["detail"]
    with pytest.raises(ConfigError, match="malformed"):
        ExecutionPlan.from_dict(data)


#: Reads of a fact back from text: the string attributes of version 1, and labels.
FACT_FROM_TEXT = re.compile(r"\.attr\(|\.attrs\b|\bin \w+\.label\b|\.label\.(startswith|split)")


def test_no_engine_strategy_or_simulator_reads_a_fact_from_a_label_or_string() -> None:
    offences = [
        f"{path.relative_to(SOURCES)}:{number}: {line.strip()}"
        for path in sorted(SOURCES.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FACT_FROM_TEXT.search(line)
    ]
    assert offences == [], "\n".join(offences)
