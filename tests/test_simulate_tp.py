"""``lamina plan --simulate`` on tensor-parallel plans: the activation collectives of ``tp``
(and ``tp+zero3``) priced per layer on the declared cluster's mesh."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lamina.cli.main import main as lamina_main
from lamina.errors import ConfigError
from lamina.runtime.nodes import Collective, Compute, Gather
from lamina.runtime.plan import CollectiveSpec, ExecutionPlan, PlanNode
from lamina.simulate import cluster_from_dict, predict
from lamina.simulate.cluster import parse_mesh_option
from lamina.simulate.report import StepPrediction
from lamina.testing.cli import run_lamina

MIB = 2**20
#: Seconds per byte and latency of the declared links.
BETA_INTRA, ALPHA_INTRA = 1 / 450e9, 3e-6
BETA_UPLINK, ALPHA_INTER = 1 / 400e9, 5e-6

#: 512 hosts x 8 GPUs, NVLink inside a host, 8 x 400 Gb/s NICs; tp inside each host.
BIG: dict[str, Any] = {
    "name": "512 x 8",
    "hosts": 512,
    "devices_per_host": 8,
    "device_memory_gib": 80,
    "intra": {"kind": "nvlink", "bandwidth_gbps": 450, "latency_us": 3},
    "inter": {"kind": "ib", "bandwidth_gbit": 400, "latency_us": 5, "nics_per_host": 8},
    "mesh": {"fsdp": 512, "tp": 8},
}


def cluster(**changes: Any) -> Any:
    data = copy.deepcopy(BIG)
    data.update(changes)
    return cluster_from_dict(data, "cluster.json")


# -- a tp+zero3 plan, by hand ----------------------------------------------------------------

#: Activation elements of one layer's collectives: batch 4 x sequence 2048 x width 4096.
ACT = 4 * 2048 * 4096


def _spec(op: str, numel: int, axis: str, group: tuple[int, ...]) -> CollectiveSpec:
    return CollectiveSpec(op, "bfloat16", numel, 2, group, axis=axis)


def _activation(node_id: str, phase: str, op: str, layer: str, numel: int = ACT) -> PlanNode:
    """A tp activation collective as ``build_tensor_plan`` writes it (captured tp=2)."""
    return PlanNode(
        f"tp.{node_id}",
        "collective",
        phase,
        f"{layer}: {op}",
        Collective("activation", layer=layer),
        _spec(op, numel, "tp", (0, 1)),
    )


def tp_zero3_plan(layers: int = 2, sequence_parallel: bool = True) -> ExecutionPlan:
    """Per layer: attention and MLP regions, each with its activation collectives on
    ``tp`` (sequence-parallel: gather in, reduce-scatter out, and their backward), and a
    ZeRO-3 unit on ``fsdp`` (gather forward and backward, reduce-scatter)."""
    nodes = [
        PlanNode(
            "tp.setup.broadcast.bfloat16",
            "collective",
            "setup",
            "broadcast",
            Collective("broadcast", source=0),
            _spec("broadcast", 100 * MIB, "world", (0, 1, 2, 3)),
        ),
        PlanNode("forward", "forward", "forward", "forward", Compute()),
        PlanNode("backward", "backward", "backward", "backward", Compute()),
    ]
    for i in range(layers):
        for region, row in (("attn", "o_proj"), ("mlp", "down_proj")):
            name = f"layers.{i}.{region}"
            if sequence_parallel:
                nodes += [
                    _activation(f"{name}.gather", "forward", "all_gather", name),
                    _activation(f"{name}.{row}.fwd", "forward", "reduce_scatter", f"{name}.{row}"),
                    _activation(f"{name}.{row}.bwd", "backward", "all_gather", f"{name}.{row}"),
                ]
            else:
                nodes.append(
                    _activation(f"{name}.{row}.fwd", "forward", "all_reduce", f"{name}.{row}")
                )
            nodes.append(_activation(f"{name}.bwd", "backward", "all_reduce", name))
        unit = f"layers.{i}"
        numel = 12 * MIB
        nodes += [
            PlanNode(
                f"{unit}.gather.fwd",
                "gather",
                "forward",
                f"gather {unit}",
                Gather(unit, "forward"),
                _spec("all_gather", numel, "fsdp", (0, 2)),
            ),
            PlanNode(
                f"{unit}.gather.bwd",
                "gather",
                "backward",
                f"gather {unit} again",
                Gather(unit, "backward"),
                _spec("all_gather", numel, "fsdp", (0, 2)),
            ),
            PlanNode(
                f"{unit}.reduce_scatter",
                "collective",
                "backward",
                f"mean gradient of {unit}",
                Collective("gradient", unit=unit),
                _spec("reduce_scatter", numel, "fsdp", (0, 2)),
            ),
        ]
    nodes.append(PlanNode("optimizer", "optimizer", "step", "optimizer", Compute()))
    return ExecutionPlan("tp+zero3", 4, "gloo", tuple(nodes), ())


def _ring_step(nbytes: int, p: int, crosses: bool) -> float:
    """One ring step of ``nbytes / p``: the slower of the intra and (if crossed) inter edge."""
    intra = ALPHA_INTRA + nbytes / p * BETA_INTRA
    return max(intra, ALPHA_INTER + nbytes / p * BETA_UPLINK) if crosses else intra


def _formula(op: str, nbytes: int, p: int, crosses: bool) -> float:
    """timing.py's ring formulas: all-reduce ``2(P-1)`` steps, gathers ``P-1`` steps."""
    steps = 2 * (p - 1) if op == "all_reduce" else p - 1
    return steps * _ring_step(nbytes, p, crosses)


def _tp(prediction: StepPrediction) -> list[Any]:
    return list(prediction.activations)


# -- time ----------------------------------------------------------------------------------------


def test_tp8_inside_a_host_of_4096_devices_uses_the_intra_link_and_the_ring_formula() -> None:
    for sequence_parallel in (True, False):
        z = predict(tp_zero3_plan(sequence_parallel=sequence_parallel), cluster())
        tp = _tp(z)
        assert tp and {c.group_size for c in tp} == {8}  # the mesh's tp, not the capture's 2
        assert {c.op for c in tp} == (
            {"all_gather", "reduce_scatter", "all_reduce"} if sequence_parallel else {"all_reduce"}
        )
        for c in tp:
            assert c.nbytes == ACT * 2
            assert c.link_seconds("inter") == 0 and c.link_seconds("intra") == c.seconds > 0
            assert c.seconds == pytest.approx(_formula(c.op, c.nbytes, 8, crosses=False), rel=1e-12)
        # zero3's units: one rank per host over 512 hosts, 8 such groups sharing each uplink
        fsdp = [c for c in z.per_step if c.axis == "fsdp"]
        assert fsdp and {c.group_size for c in fsdp} == {512}
        assert all(c.link_seconds("inter") == c.seconds for c in fsdp)
        n = 12 * MIB * 2
        step = ALPHA_INTER + n / 512 * 8 * BETA_UPLINK
        assert fsdp[0].seconds == pytest.approx(511 * step)
        assert z.memory.shard_group == 512
        tp_group = "tp (mesh axis): 8 rank(s) on 1 host(s) x 8, inside one host (intra link)"
        assert any(g.startswith(tp_group) for g in z.groups)


def test_tp16_on_8_device_hosts_crosses_hosts_and_pays_the_inter_link() -> None:
    c = cluster(mesh={"fsdp": 256, "tp": 16})
    z = predict(tp_zero3_plan(), c)
    tp = _tp(z)
    assert {t.group_size for t in tp} == {16}
    for t in tp:
        assert t.link_seconds("intra") == 0 and t.link_seconds("inter") == t.seconds
        assert t.seconds == pytest.approx(_formula(t.op, t.nbytes, 16, crosses=True), rel=1e-12)
    inside = predict(tp_zero3_plan(), cluster())
    assert sum(t.seconds for t in tp) > sum(t.seconds for t in inside.activations)
    text = z.report()
    assert "tp (mesh axis): 16 rank(s) on 2 host(s) x 8, CROSSES HOSTS: 2 hosts (inter-host" in text
    assert "fsdp (mesh axis): 256 rank(s) on 256 host(s) x 1, across 256 hosts" in text
    assert "the tp group is the simulated mesh's (tp=16, the capture's had 2), it CROSSES" in text
    # fsdp outside tp=16: one rank per host of 256 hosts (stride 16)
    assert {t.group_size for t in z.per_step if t.axis == "fsdp"} == {256}


def test_activation_bytes_are_not_scaled_by_the_data_parallel_world() -> None:
    small = predict(tp_zero3_plan(), cluster(hosts=4, mesh={"fsdp": 4, "tp": 8}))
    big = predict(tp_zero3_plan(), cluster())
    assert [(t.node, t.nbytes, t.seconds) for t in small.activations] == [
        (t.node, t.nbytes, t.seconds) for t in big.activations
    ]
    assert big.total_s > small.total_s  # only fsdp's rings grow


def test_dp_plus_fsdp_axes_and_a_three_axis_mesh() -> None:
    plan = tp_zero3_plan()
    nodes = tuple(
        n
        if n.collective is None or n.collective.axis != "fsdp"
        else PlanNode(
            n.id,
            n.kind,
            n.phase,
            n.label,
            n.detail,
            _spec(n.collective.op, n.collective.numel, "dp+fsdp", (0, 2)),
        )
        for n in plan.nodes
    )
    mesh = {"dp": 64, "fsdp": 8, "tp": 8}
    z = predict(ExecutionPlan(plan.strategy, 4, "gloo", nodes, ()), cluster(mesh=mesh))
    assert {t.group_size for t in z.per_step if t.axis == "dp+fsdp"} == {512}
    assert {t.group_size for t in z.activations} == {8}


# -- the report ------------------------------------------------------------------------------


def test_the_report_lists_activation_collectives_per_layer_and_counts_them_in_the_step() -> None:
    z = predict(tp_zero3_plan(layers=3), cluster())
    rows = z.by_layer()
    assert [(r.layer, r.op) for r in rows[:3]] == [
        ("layers.0.attn", "all_gather"),
        ("layers.0.attn.o_proj", "reduce_scatter"),
        ("layers.0.attn.o_proj", "all_gather"),
    ]
    assert all(r.link == "intra" and r.count == 1 and r.nbytes == ACT * 2 for r in rows)
    assert sum(r.seconds for r in rows) == pytest.approx(z.activation_s)
    assert z.total_s == pytest.approx(
        z.activation_s + sum(c.seconds for c in z.per_step if c.purpose != "activation")
    )
    text = z.report()
    assert "tensor-parallel activation collectives per layer (24 on the tp group of 8" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("layers.2.mlp.down_proj"))
    assert "reduce_scatter" in line and "64 MiB" in line and "intra" in line
    per_step = next(x for x in text.splitlines() if x.startswith("per step: "))
    assert "tensor-parallel activations" in per_step and "24 collective(s)" in per_step
    assert "not scaled by the simulated data-parallel world" in text
    assert "mesh fsdp=512 x tp=8" in text.splitlines()[0]
    data = z.to_json()
    assert data["activations"]["collectives"] == 24
    assert data["activations"]["seconds"] == pytest.approx(z.activation_s)
    assert data["activations"]["by_layer"][0]["layer"] == "layers.0.attn"
    assert data["cluster"]["mesh"] == {"fsdp": 512, "tp": 8}
    assert {c["layer"] for c in data["collectives"] if c["purpose"] == "activation"} == {
        r.layer for r in rows
    }
    json.dumps(data)


def test_a_derived_tp_plan_composed_with_zero3_is_priced_per_layer() -> None:
    from lamina.strategies.tp.derive import derive_plan
    from lamina.strategies.tp.plan_nodes import build_tensor_plan
    from models_for_tests import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    layers = derive_plan(model, (ids,), None, 2, sequence_parallel=True)
    tp = build_tensor_plan(layers, model, (0, 1), "tp", 4, "gloo")
    zero3 = tp_zero3_plan(layers=1)
    nodes = (
        *(n for n in tp.nodes if n.kind == "collective"),
        *(n for n in zero3.nodes if not n.id.startswith("tp.")),
    )
    plan = ExecutionPlan("tp+zero3", 4, "gloo", nodes, ())
    z = predict(plan, cluster())
    layer_of = {n.id: n.facts(Collective).layer for n in tp.collectives() if n.facts(Collective)}
    timed = {t.node: t for t in z.activations}
    assert set(timed) == {i for i, layer in layer_of.items() if layer}
    for node in tp.collectives():
        spec = node.collective
        if node.id in timed:
            assert spec is not None and timed[node.id].nbytes == spec.nbytes
            assert timed[node.id].group_size == 8 and timed[node.id].layer == layer_of[node.id]
    assert "model.layers.0.self_attn" in z.report()


def test_a_tp_only_plan_splits_the_model_state_over_tp() -> None:
    plan = tp_zero3_plan()
    nodes = tuple(n for n in plan.nodes if n.collective is None or n.collective.axis != "fsdp")
    only = ExecutionPlan("tp", 2, "gloo", nodes, ())
    z = predict(only, cluster(mesh={"dp": 512, "tp": 8}))
    assert z.memory.split_axis == "tp" and z.memory.shard_group == 8
    assert z.memory.local_elements == 100 * MIB // 8
    assert "memory per rank (tp, split over tp=8" in z.report()


# -- speed ---------------------------------------------------------------------------------------


def test_a_4096_device_tp_zero3_prediction_runs_well_under_seconds() -> None:
    plan = tp_zero3_plan(layers=48)
    started = time.process_time()
    for mesh in ({"fsdp": 512, "tp": 8}, {"fsdp": 256, "tp": 16}):
        z = predict(plan, cluster(mesh=mesh))
        z.report()
    elapsed = time.process_time() - started
    assert elapsed < 1.0, f"took {elapsed:.2f} s of CPU time"
    assert len(z.activations) == 48 * 8


# -- the mesh: the cluster file, --mesh, and the plan's axes -----------------------------------


@pytest.mark.parametrize(
    ("mesh", "expected"),
    [
        ([512, 8], '"mesh" must map axis names to sizes, outermost first, got [512, 8]'),
        ({}, '"mesh" must map axis names to sizes, outermost first, got no axes'),
        ({"fsdp": 256, "tp": 8}, '"mesh" = fsdp 256 x tp 8 = 2048 ranks, but the cluster has'),
        ({"fsdp": 512, "tp": "8"}, '"mesh.tp" must be a positive integer, got "8"'),
        ({"fsdp": 4096, "tp": 0}, '"mesh.tp" must be a positive integer, got 0'),
        ({"world": 512, "tp": 8}, '"mesh.world" is not an axis name'),
        ({"dp+fsdp": 512, "tp": 8}, '"mesh.dp+fsdp" is not an axis name'),
        ({"a": 2, "b": 2, "c": 2, "d": 2, "e": 256}, '"mesh" has 5 axes'),
    ],
)
def test_each_bad_mesh_is_named_with_its_fix(mesh: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        cluster(mesh=mesh)
    message = str(err.value)
    assert message.startswith("cluster.json: ") and expected in message, message
    assert "\n" not in message and ";" in message


def test_a_mesh_that_splits_hosts_unevenly_is_refused() -> None:
    with pytest.raises(ConfigError, match=r'"mesh.tp" and the axes inside it span 4 consecutive'):
        cluster(hosts=4, devices_per_host=6, mesh={"fsdp": 6, "tp": 4})
    assert cluster(hosts=4, devices_per_host=6, mesh={"fsdp": 8, "tp": 3}).mesh == (
        ("fsdp", 8),
        ("tp", 3),
    )


def test_a_plan_on_two_axes_needs_a_mesh_that_names_them() -> None:
    no_mesh = copy.deepcopy(BIG)
    del no_mesh["mesh"]
    with pytest.raises(ConfigError) as err:
        predict(tp_zero3_plan(), cluster_from_dict(no_mesh, "cluster.json"))
    message = str(err.value)
    assert message.startswith('cluster.json: "mesh" is missing: the tp+zero3 plan')
    assert '"mesh": {"fsdp": 512, "tp": 8}' in message and "\n" not in message
    with pytest.raises(ConfigError, match=r'"mesh" dp=512 x tp=8 has no axis \'fsdp\''):
        predict(tp_zero3_plan(), cluster(mesh={"dp": 512, "tp": 8}))


def test_a_plan_on_one_joined_axis_needs_no_mesh() -> None:
    plan = tp_zero3_plan()
    nodes = tuple(
        PlanNode(
            n.id,
            n.kind,
            n.phase,
            n.label,
            n.detail,
            _spec(n.collective.op, 1024, "dp+fsdp", (0, 1)),
        )
        if n.collective is not None and n.collective.axis == "fsdp"
        else n
        for n in plan.nodes
        if n.collective is None or n.collective.axis != "tp"
    )
    no_mesh = copy.deepcopy(BIG)
    del no_mesh["mesh"]
    z = predict(ExecutionPlan("zero3", 4, "gloo", nodes, ()), cluster_from_dict(no_mesh))
    assert {t.group_size for t in z.per_step} == {4096} and not z.activations


def test_the_mesh_option_parses_and_names_its_mistakes() -> None:
    assert parse_mesh_option("fsdp=512, tp=8") == {"fsdp": 512, "tp": 8}
    for bad in ("fsdp512", "fsdp=x", "=8", "tp=8,tp=8"):
        with pytest.raises(ConfigError, match=r"^--mesh .*; .*--mesh fsdp=512,tp=8|given twice"):
            parse_mesh_option(bad)


def test_the_cli_rejects_a_bad_mesh_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(BIG))
    missing = str(tmp_path / "missing.py")
    status = lamina_main(["plan", "--simulate", str(path), "--mesh", "fsdp=8,tp=8", missing])
    assert status == 2
    err = capsys.readouterr().err
    assert '--mesh: "mesh" = fsdp 8 x tp 8 = 64 ranks, but the cluster has' in err
    assert "missing.py" not in err
    status = lamina_main(["plan", "--mesh", "fsdp=512,tp=8", missing])
    assert status == 2 and "add --simulate CLUSTER.json" in capsys.readouterr().err


TP_SCRIPT = """
import torch
from torch import nn
import lamina

lamina.init(mesh={"tp": 2})
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
x = torch.randn(4, 64)
model = lamina.distribute(model, "tp", example_inputs=(x,))
model(x).sum().backward()
lamina.shutdown()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_lamina_plan_simulate_prices_a_tp_scripts_activation_collectives(tmp_path: Path) -> None:
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    data = {k: v for k, v in BIG.items() if k != "mesh"}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    result = run_lamina(
        "plan",
        "--simulate",
        str(path),
        "--mesh",
        "dp=512,tp=8",
        "--json",
        str(script),
        env={"LAMINA_BACKEND": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["strategy"] == "tp" and out["cluster"]["mesh"] == {"dp": 512, "tp": 8}
    tp = [c for c in out["collectives"] if c["purpose"] == "activation"]
    assert tp and all(c["group_size"] == 8 and c["inter_s"] == 0 for c in tp)
    assert out["activations"]["collectives"] == len(tp)
    # the root region (the Sequential) and its row-parallel linear "2": 4 x 64 fp32 each
    rows = {(r["layer"], r["op"]): r for r in out["activations"]["by_layer"]}
    assert set(rows) == {
        ("(root)", "all_gather"),
        ("2", "reduce_scatter"),
        ("2", "all_gather"),
        ("2", "all_reduce"),  # its bias, added on the sequence slices: gradient summed
        ("(root)", "all_reduce"),
    }
    bias = rows.pop(("2", "all_reduce"))
    assert bias["bytes"] == 64 * 4 and bias["link"] == "intra"
    assert all(r["bytes"] == 4 * 64 * 4 and r["link"] == "intra" for r in rows.values())
    expected = 2 * 7 * (ALPHA_INTRA + 4 * 64 * 4 / 8 * BETA_INTRA)
    assert rows[("(root)", "all_reduce")]["seconds"] == pytest.approx(expected)
