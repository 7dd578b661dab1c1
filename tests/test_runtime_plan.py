"""The execution plan as data: building, serializing, fingerprinting, rendering, choices."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lamina.comm.buckets import ParamSpec, plan_buckets
from lamina.comm.codecs import BUILTIN_CODECS, Codec, self_check
from lamina.errors import ConfigError
from lamina.graph import capture
from lamina.memory import build_layout, group_units
from lamina.runtime import Compute, ExecutionPlan, PlanNode, RunLog, explain
from lamina.runtime.primitives import choose_primitive, disabled_from_env
from lamina.strategies.codec_registry import resolve_codec
from lamina.strategies.dp.plan import DPPlanInputs, bucket_node, build_dp_plan
from lamina.strategies.zero3.plan import PlanGroups, Zero3PlanInputs, build_zero3_plan

pytestmark = pytest.mark.portable


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)]
    return nn.Sequential(*layers)


def _dp_plan(world: int = 2, codec: str | None = None, cap: int = 4096) -> ExecutionPlan:
    model = _mlp()
    graph = capture(model, (torch.randn(2, 16),))
    named = dict(model.named_parameters())
    specs = [ParamSpec(n, tuple(named[n].shape), named[n].dtype) for n in graph.param_names]
    buckets = plan_buckets(specs, graph.grad_ready_order(), cap_bytes=cap, first_bucket_bytes=cap)
    chosen = resolve_codec(codec)
    return build_dp_plan(
        DPPlanInputs(
            graph=graph,
            buckets=buckets,
            group=tuple(range(world)),
            backend="cpu",
            pg_backend="gloo",
            setup_state=[("float32", sum(p.numel() for p in model.parameters()))],
            step_buffers=[],
            codec=chosen,
            codec_checks={"float32": ""},
        )
    )


def test_dp_plan_has_one_all_reduce_per_bucket_in_ready_order() -> None:
    plan = _dp_plan()
    sequence = [n.id for n in plan.collectives()]
    buckets = [n for n in sequence if n.startswith("bucket")]
    assert sequence[0] == "setup.broadcast.float32"
    assert buckets == [bucket_node(i) for i in range(len(buckets))] and len(buckets) > 1
    first = plan.node(buckets[0])
    assert first.collective is not None and first.collective.op == "all_reduce"
    assert "4.bias" in first.label  # the last layer's gradients are ready first
    order = plan.topological_order()
    assert order.index("forward") < order.index("backward") < order.index(buckets[0])
    assert order[-1] == "optimizer"


def test_plan_json_round_trip_and_stable_fingerprint() -> None:
    plan = _dp_plan(codec="bf16")
    again = ExecutionPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan and again.fingerprint == plan.fingerprint
    assert _dp_plan(codec="bf16").fingerprint == plan.fingerprint
    assert _dp_plan(cap=8192).fingerprint != _dp_plan().fingerprint
    assert _dp_plan(codec="bf16").fingerprint != _dp_plan().fingerprint


def test_codec_shows_on_the_wire_and_halves_bytes() -> None:
    plain, coded = _dp_plan(), _dp_plan(codec="bf16")
    per_step = [n for n in coded.collectives() if n.phase == "backward"]
    assert all(n.collective and n.collective.wire_dtype == "bfloat16" for n in per_step)
    plain_bytes = sum(n.collective.nbytes for n in plain.collectives() if n.phase == "backward")  # type: ignore[union-attr]
    coded_bytes = sum(n.collective.nbytes for n in per_step)  # type: ignore[union-attr]
    assert coded_bytes * 2 == plain_bytes
    run = [f for f in coded.fallbacks if f.when == "run"]
    assert run and all(f.alternative == "uncompressed" for f in run)


def test_one_rank_plan_has_no_collectives() -> None:
    plan = _dp_plan(world=1)
    assert plan.collectives() == []
    assert "(none: one rank)" in explain(plan)


def test_explain_lists_nodes_sequence_and_fallbacks() -> None:
    text = explain(_dp_plan(codec="fp16"))
    assert "execution plan: dp on cpu, 2 rank(s)" in text
    assert "collective sequence" in text and "float32->float16" in text
    assert "capture:export -> capture:fx" in text and "codec:fp16 -> uncompressed" in text


def test_malformed_plans_are_rejected_with_the_field() -> None:
    data = json.loads(_dp_plan().to_json())
    with pytest.raises(ConfigError, match="version"):
        ExecutionPlan.from_dict({**data, "version": 99})
    with pytest.raises(ConfigError, match="malformed"):
        ExecutionPlan.from_dict({k: v for k, v in data.items() if k != "nodes"})
    with pytest.raises(ConfigError, match="names no node"):
        ExecutionPlan.from_dict({**data, "edges": [["forward", "nowhere"]]})
    nodes = (
        PlanNode("a", "forward", "forward", "a", Compute()),
        PlanNode("b", "backward", "backward", "b", Compute()),
    )
    with pytest.raises(ConfigError, match="appears twice"):
        ExecutionPlan("dp", 1, "cpu", (nodes[0], nodes[0]), ())
    cyclic = ExecutionPlan("dp", 1, "cpu", nodes, (("a", "b"), ("b", "a")))
    with pytest.raises(ConfigError, match="cycle"):
        cyclic.topological_order()


def test_primitive_choice_and_reasons() -> None:
    assert choose_primitive("reduce_scatter", "nccl").op == "reduce_scatter"
    gloo = choose_primitive("reduce_scatter", "gloo")
    assert gloo.op == "all_to_all" and "faster" in gloo.reason
    assert gloo.alternative == "all_to_all + local sum"
    assert choose_primitive("all_gather", "gloo", group_size=8).op == "broadcast"
    many = choose_primitive("all_gather", "gloo", group_size=9)
    assert many.op == "all_reduce" and "9 ranks are too many" in many.reason
    assert many.alternative == "all_reduce of a zero-filled buffer"
    assert choose_primitive("reduce_scatter", "gloo", mode="native").op == "reduce_scatter"
    off = choose_primitive("all_gather", "nccl", disable={"all_gather"})
    assert off.fell_back and "disabled" in off.reason
    lacking = choose_primitive("all_gather", "hccl", unsupported={"all_gather"})
    assert "lacks all_gather" in lacking.reason
    with pytest.raises(ConfigError, match="collectives="):
        choose_primitive("all_gather", "gloo", mode="fastest")
    assert disabled_from_env({"LAMINA_DISABLE_COLLECTIVES": "reduce_scatter, all_gather"}) == {
        "reduce_scatter",
        "all_gather",
    }
    with pytest.raises(ConfigError, match="LAMINA_DISABLE_COLLECTIVES"):
        disabled_from_env({"LAMINA_DISABLE_COLLECTIVES": "all_scatter"})


def test_zero3_plan_gathers_and_scatters_every_unit() -> None:
    model = _mlp()
    layout = build_layout(model, 2, units=group_units(model, min_unit_numel=1))
    names = [u.name for u in layout.units]
    plan = build_zero3_plan(
        Zero3PlanInputs(
            layout=layout,
            forward_order=names,
            whole_forward=frozenset(),
            groups=PlanGroups(shard=(0, 1), shard_axis="dp", everyone=(0, 1), everyone_axis="dp"),
            backend="cpu",
            pg_backend="gloo",
            gather=choose_primitive("all_gather", "gloo"),
            scatter=choose_primitive("reduce_scatter", "gloo", mode="native"),
            setup_state=[("float32", 10)],
            compute_dtype="bfloat16",
        )
    )
    for name in names:
        gather = plan.node(f"{name}.gather.fwd").collective
        scatter = plan.node(f"{name}.reduce_scatter").collective
        assert gather is not None and gather.op == "broadcast" and gather.dtype == "bfloat16"
        assert scatter is not None and scatter.op == "reduce_scatter" and scatter.dtype == "float32"
    taken = [f for f in plan.fallbacks if f.taken]
    assert taken and all(".gather." in f.node for f in taken)
    order = plan.topological_order()
    assert order.index(f"{names[-1]}.forward") < order.index(f"{names[-1]}.backward")
    assert order.index(f"{names[0]}.backward") > order.index(f"{names[-1]}.backward")
    assert not [n for n in plan.nodes if n.id.endswith(".all_reduce.replicas")]  # no replicas


def test_hsdp_plan_shards_inside_a_host_and_all_reduces_shards_across_hosts() -> None:
    model = _mlp()
    layout = build_layout(model, 2, units=group_units(model, min_unit_numel=1))
    names = [u.name for u in layout.units]
    # rank 2 of a 2-host x 2-rank mesh: intra group [2, 3], inter group [0, 2]
    groups = PlanGroups(
        shard=(2, 3),
        shard_axis="intra",
        replicate=(0, 2),
        replicate_axis="inter",
        everyone=(0, 1, 2, 3),
        everyone_axis="inter+intra",
    )
    inputs = Zero3PlanInputs(
        layout=layout,
        forward_order=names,
        whole_forward=frozenset(),
        groups=groups,
        backend="cpu",
        pg_backend="gloo",
        gather=choose_primitive("all_gather", "gloo", mode="native"),
        scatter=choose_primitive("reduce_scatter", "gloo", mode="native"),
        setup_state=[("float32", 10)],
        strategy="hsdp",
    )
    plan = build_zero3_plan(inputs)
    assert plan.strategy == "hsdp" and dict(plan.meta)["shard_axis"] == "intra"
    setup = plan.node("setup.broadcast.float32").collective
    assert setup is not None and (setup.axis, setup.group) == ("inter+intra", (0, 1, 2, 3))
    for unit in layout.units:
        gather = plan.node(f"{unit.name}.gather.fwd").collective
        scatter = plan.node(f"{unit.name}.reduce_scatter").collective
        across = plan.node(f"{unit.name}.all_reduce.replicas").collective
        assert gather is not None and (gather.axis, gather.group) == ("intra", (2, 3))
        assert scatter is not None and (scatter.axis, scatter.group) == ("intra", (2, 3))
        assert across is not None and (across.op, across.axis, across.group) == (
            "all_reduce",
            "inter",
            (0, 2),
        )
        assert across.numel == unit.shard_numel  # only the shard crosses the slow link
    order = plan.topological_order()
    last = names[-1]
    assert order.index(f"{last}.reduce_scatter") < order.index(f"{last}.all_reduce.replicas")
    assert order.index(f"{last}.all_reduce.replicas") < order.index("optimizer")
    # rank 0 (intra [0, 1], inter [0, 2]) has the same canonical plan and fingerprint
    rank0 = build_zero3_plan(
        Zero3PlanInputs(
            **{
                **inputs.__dict__,
                "groups": PlanGroups(
                    shard=(0, 1),
                    shard_axis="intra",
                    replicate=(0, 2),
                    replicate_axis="inter",
                    everyone=(0, 1, 2, 3),
                    everyone_axis="inter+intra",
                ),
            }
        )
    )
    assert rank0.collective_sequence() == plan.collective_sequence()
    assert rank0.fingerprint == plan.fingerprint
    assert "on intra (2 ranks)" in plan.collective_sequence()[1]
    assert "intra [2, 3]" in explain(plan) and "inter [0, 2]" in explain(plan)


def test_run_log_counts_issued_collectives_and_checks_fallbacks() -> None:
    plan = _dp_plan(codec="fp16")
    log = RunLog(plan)
    log.begin_step()
    for node in plan.collectives():
        if node.phase == "backward":
            log.issued(node.id)
    log.fallback(bucket_node(0), "uncompressed", "codec fp16 overflowed")
    summary = log.summary()
    assert "planned collectives" in summary and "codec fp16 overflowed" in summary
    with pytest.raises(ConfigError, match="no run-time fallback"):
        log.fallback("forward", "eager", "not declared without compile")
    with pytest.raises(ConfigError, match="not a collective"):
        log.issued("forward")


class _BrokenCodec(Codec):
    name = "broken"
    wire_dtype = torch.float16
    tolerance = 1e-3

    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no such kernel")

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(wire)


def test_codec_self_check() -> None:
    cpu = torch.device("cpu")
    assert self_check(BUILTIN_CODECS["bf16"], torch.float32, cpu) == ""
    assert self_check(BUILTIN_CODECS["fp16"], torch.float32, cpu) == ""
    reason = self_check(_BrokenCodec(), torch.float32, cpu)
    assert reason == "codec broken failed its self-check: RuntimeError: no such kernel"
    assert not BUILTIN_CODECS["bf16"].applies_to(torch.bfloat16)
    with pytest.raises(ConfigError, match="codec 'zip' is unknown"):
        resolve_codec("zip")
