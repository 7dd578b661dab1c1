"""``lamina plan --simulate``: the cluster file, the time and memory predictions, the CLI."""

from __future__ import annotations

import copy
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from lamina.cli.main import main as lamina_main
from lamina.comm.cost import CostModel
from lamina.comm.layout import HostLayout
from lamina.errors import ConfigError
from lamina.runtime.nodes import Collective, Compute, Gather
from lamina.runtime.plan import CollectiveSpec, ExecutionPlan, PlanNode
from lamina.simulate import MAX_DEVICES, cluster_from_dict, load_cluster, predict
from lamina.simulate.cluster import ClusterCostModel
from lamina.testing.cli import run_lamina

MIB = 2**20

#: 512 hosts x 8 GPUs: NVLink inside a host, 8 x 400 Gb/s NICs per host.
BIG: dict[str, Any] = {
    "name": "512 x 8",
    "hosts": 512,
    "devices_per_host": 8,
    "device_memory_gib": 80,
    "intra": {"kind": "nvlink", "bandwidth_gbps": 450, "latency_us": 3},
    "inter": {"kind": "ib", "bandwidth_gbit": 400, "latency_us": 5, "nics_per_host": 8},
}


def cluster(**changes: Any) -> Any:
    data = copy.deepcopy(BIG)
    for key, value in changes.items():
        if "__" in key:
            outer, inner = key.split("__")
            data[outer][inner] = value
        else:
            data[key] = value
    return cluster_from_dict(data, "cluster.json")


# -- synthetic plans ------------------------------------------------------------------------


def _spec(op: str, numel: int, axis: str = "dp", size: int = 4) -> CollectiveSpec:
    return CollectiveSpec(op, "float32", numel, size, (0, 1), axis=axis)


def dp_plan(buckets: list[int]) -> ExecutionPlan:
    """A DP plan with one all-reduce per bucket (numels) and the wrap-time broadcast."""
    nodes = [
        PlanNode(
            "setup.broadcast.float32",
            "collective",
            "setup",
            "broadcast",
            Collective("broadcast", source=0),
            _spec("broadcast", sum(buckets)),
        ),
        PlanNode("forward", "forward", "forward", "forward", Compute()),
        PlanNode("backward", "backward", "backward", "backward", Compute()),
    ]
    for i, numel in enumerate(buckets):
        nodes.append(
            PlanNode(
                f"bucket{i}.all_reduce",
                "collective",
                "backward",
                f"bucket {i}",
                Collective("gradient", bucket=i),
                _spec("all_reduce", numel),
            )
        )
    nodes.append(PlanNode("optimizer", "optimizer", "step", "optimizer", Compute()))
    return ExecutionPlan("dp", 2, "cpu", tuple(nodes), ())


def zero3_plan(
    units: dict[str, int],
    whole: tuple[str, ...] = ("(root)",),
    axis: str = "dp",
    replicas: str = "",
) -> ExecutionPlan:
    """A ZeRO-3 plan (HSDP with ``replicas``): gather per unit in forward and backward,
    reduce-scatter per unit; ``whole`` units are gathered for the whole forward."""
    nodes: list[PlanNode] = []
    for name, numel in units.items():
        span = "whole_forward" if name in whole else "forward"
        nodes.append(
            PlanNode(
                f"{name}.gather.fwd",
                "gather",
                "forward",
                f"gather {name}",
                Gather(name, span),
                _spec("all_gather", numel, axis),
            )
        )
    for name, numel in reversed(units.items()):
        if name not in whole:
            nodes.append(
                PlanNode(
                    f"{name}.gather.bwd",
                    "gather",
                    "backward",
                    f"gather {name} again",
                    Gather(name, "backward"),
                    _spec("all_gather", numel, axis),
                )
            )
        nodes.append(
            PlanNode(
                f"{name}.reduce_scatter",
                "collective",
                "backward",
                f"mean gradient of {name}",
                Collective("gradient", unit=name),
                _spec("reduce_scatter", numel, axis),
            )
        )
        if replicas:
            nodes.append(
                PlanNode(
                    f"{name}.all_reduce.replicas",
                    "collective",
                    "backward",
                    f"replicas of {name}",
                    Collective("replicate", unit=name),
                    _spec("all_reduce", -(-numel // 8), replicas),
                )
            )
    strategy = "hsdp" if replicas else "zero3"
    return ExecutionPlan(strategy, 2, "cpu", tuple(nodes), (), replicate_axis=replicas)


# -- the cluster file -------------------------------------------------------------------------


def test_the_big_cluster_loads_with_nics_in_gbit(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(BIG))
    c = load_cluster(path)
    assert (c.world_size, c.nics_per_host) == (4096, 8)
    assert c.inter.bandwidth_gbps == 50.0 and c.uplink_gbps == 400.0  # 400 Gb/s = 50 GB/s
    model = c.cost_model()
    assert model.layout.size == 4096 and model.layout.per_host == 8
    assert model.inter.beta_s_per_byte == pytest.approx(1 / 400e9)
    assert model.intra.beta_s_per_byte == pytest.approx(1 / 450e9)
    assert model.inter.alpha_s == pytest.approx(5e-6)
    assert c.device_memory_bytes == 80 * 2**30
    assert "4096 devices" in c.describe() and "400 GB/s uplink" in c.describe()


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"hosts": "x"}, '"hosts" must be a positive integer, got "x"'),
        ({"hosts": 0}, '"hosts" must be a positive integer, got 0'),
        ({"devices_per_host": True}, '"devices_per_host" must be a positive integer, got true'),
        ({"devices_per_host": 2.5}, '"devices_per_host" must be a positive integer'),
        ({"hosts": 1024}, "1024 x 8 = 8192 devices, over the limit of 4096"),
        ({"device_memory_gib": -1}, '"device_memory_gib" must be a number > 0, got -1'),
        ({"name": 3}, '"name" must be a string, got 3'),
        ({"gpus": 8}, '"gpus" is not a known field'),
        ({"intra": 450}, '"intra" must be an object'),
        ({"intra__bandwidth_gbps": -5}, '"intra.bandwidth_gbps" must be a number > 0, got -5'),
        ({"intra__latency_us": "fast"}, '"intra.latency_us" must be a number >= 0, got "fast"'),
        ({"intra__kind": ""}, '"intra.kind" must be a non-empty string'),
        ({"inter__bandwidth_gbps": 50}, '"inter.bandwidth_gbps" needs exactly one of'),
        ({"inter__bandwidth_gbit": "400G"}, '"inter.bandwidth_gbit" must be a number > 0'),
        ({"inter__nics_per_host": 0}, '"inter.nics_per_host" must be a positive integer, got 0'),
        ({"inter__speed": 1}, '"inter.speed" is not a known field'),
    ],
)
def test_each_bad_field_is_named_with_its_fix(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        cluster(**changes)
    message = str(err.value)
    assert message.startswith("cluster.json: ") and expected in message
    assert "\n" not in message and ";" in message  # one line, with the fix


@pytest.mark.parametrize(("drop", "field"), [("intra", '"intra" is missing'), ("inter", '"inter"')])
def test_a_missing_link_class_is_named(drop: str, field: str) -> None:
    data = copy.deepcopy(BIG)
    del data[drop]
    with pytest.raises(ConfigError, match=field):
        cluster_from_dict(data, "cluster.json")
    data["hosts" if drop == "inter" else "devices_per_host"] = 1  # then it is not needed
    assert cluster_from_dict(data, "c.json").world_size in (8, 512)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope.json: no such file; pass a cluster JSON"):
        load_cluster(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"hosts": 2,')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON .*; fix the syntax"):
        load_cluster(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must hold a JSON object, got an array"):
        load_cluster(bad)


def test_the_cli_rejects_a_bad_cluster_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps({**BIG, "hosts": "x"}))
    # the script does not exist either: the cluster error comes first, nothing launches
    status = lamina_main(["plan", "--simulate", str(bad), str(tmp_path / "missing.py")])
    assert status == 2
    err = capsys.readouterr().err
    assert '"hosts" must be a positive integer, got "x"' in err and "missing.py" not in err


# -- time -----------------------------------------------------------------------------------


def test_a_4096_device_prediction_takes_well_under_seconds() -> None:
    # this process's CPU time, not the wall clock, which other processes stretch: at load
    # average 11-17 on 2 cores, six copies at once took 0.18-5.3 s of wall clock but
    # 0.10-0.12 s of CPU time each; each ring is walked once, then priced in O(1)
    buckets = [int(1.3**i) * 1024 + 128 * i for i in range(40)]
    units = {"(root)": 50_000_000, **{f"blocks.{i}": 12_600_000 + i for i in range(48)}}
    started = time.process_time()
    dp = predict(dp_plan(buckets), cluster())
    z3 = predict(zero3_plan(units), cluster())
    elapsed = time.process_time() - started
    assert elapsed < 1.0, f"took {elapsed:.2f} s of CPU time"
    assert len(dp.per_step) == 40 and len(z3.per_step) == 49 + 48 + 49
    assert dp.total_s > 0 and z3.total_s > 0


def test_phases_add_up_to_the_cost_models_choice() -> None:
    c = cluster(hosts=64)
    model = c.cost_model()
    for numel in (256, 64 * 1024, 16 * MIB, 256 * MIB):
        timed = predict(dp_plan([numel]), c).per_step[0]
        chosen = model.choose(numel * 4)
        assert timed.algorithm == chosen.algorithm and timed.chunks == chosen.chunks
        assert timed.seconds == pytest.approx(chosen.seconds, rel=1e-9)
        assert timed.link_seconds("intra") + timed.link_seconds("inter") == pytest.approx(
            timed.seconds
        )
    # one device per host: only the rings can run; both halves on the uplink
    rings = cluster(hosts=16, devices_per_host=1)
    timed = predict(dp_plan([MIB]), rings).per_step[0]
    assert timed.algorithm in ("flat", "ordered")
    assert [p.name for p in timed.phases] == ["reduce-scatter", "all-gather"]
    assert timed.link_seconds("inter") == timed.seconds
    assert timed.seconds == pytest.approx(rings.cost_model().predict("flat", 4 * MIB).seconds)


def test_the_cluster_model_prices_rings_as_the_base_model() -> None:
    layouts = [
        HostLayout(("a", "b"), ((0, 2), (1, 3))),  # interleaved: flat crosses twice per host
        HostLayout(("a", "b", "c"), ((0, 1, 2), (3, 4, 5), (6, 7, 8))),
        HostLayout(("a",), ((0, 1, 2, 3),)),
    ]
    c = cluster()
    for layout in layouts:
        fast = ClusterCostModel(layout, c.intra.cost(), c.inter.cost(links=8), "declared")
        base = CostModel(layout, fast.intra, fast.inter, "declared")
        for nbytes in (64, 1 << 20, 1 << 30):
            assert fast.predictions(nbytes) == base.predictions(nbytes)
            assert fast.choose(nbytes) == base.choose(nbytes)


def test_doubling_hosts_never_shortens_a_flat_ring() -> None:
    nbytes = 64 * MIB
    times = []
    for hosts in (32, 64, 128, 256, 512):
        model = cluster(hosts=hosts).cost_model()
        times.append(model.predict("flat", nbytes).seconds)
    assert all(b >= a for a, b in itertools_pairs(times)), times
    # bandwidth-bound part tends to 2n / uplink, the latency part grows with P
    assert times[-1] > 2 * nbytes / 400e9


def itertools_pairs(values: list[float]) -> list[tuple[float, float]]:
    return list(itertools.pairwise(values))


def test_slow_nics_make_large_buckets_hierarchical() -> None:
    slow = cluster(hosts=64, inter__bandwidth_gbit=25, inter__nics_per_host=1)
    timed = predict(dp_plan([256 * MIB // 4]), slow).per_step[0]
    assert timed.algorithm in ("hierarchical", "pipelined")
    assert timed.link_seconds("inter") > 10 * timed.link_seconds("intra")
    uplink = 25e9 / 8
    assert timed.seconds == pytest.approx(2 * 63 / 64 * 256 * MIB / uplink, rel=0.1)
    flat = slow.cost_model().predict("flat", 256 * MIB).seconds
    assert timed.seconds < 0.98 * flat


def test_zero3_gathers_are_rings_of_p_minus_1_steps() -> None:
    c = cluster(hosts=4)
    numel = 8 * MIB
    z3 = predict(zero3_plan({"(root)": numel}), c)
    gather = z3.per_step[0]
    assert (gather.op, gather.group_size, gather.algorithm) == ("all_gather", 32, "ring")
    n, p = numel * 4, 32
    step = max(3e-6 + n / p / 450e9, 5e-6 + n / p / 400e9)
    assert gather.seconds == pytest.approx((p - 1) * step)
    assert gather.link_seconds("inter") == gather.seconds  # the uplink is the bottleneck
    scatter = z3.per_step[-1]
    assert scatter.op == "reduce_scatter" and scatter.seconds == pytest.approx(gather.seconds)


def test_hsdp_axes_map_to_one_host_and_one_rank_per_host() -> None:
    c = cluster(hosts=16)
    plan = zero3_plan({"a": MIB, "b": MIB}, whole=(), axis="intra", replicas="inter")
    z = predict(plan, c)
    gathers = [t for t in z.per_step if t.op == "all_gather"]
    replicas = [t for t in z.per_step if t.node.endswith(".replicas")]
    assert {t.group_size for t in gathers} == {8} and all(
        t.link_seconds("inter") == 0 for t in gathers
    )
    assert {t.group_size for t in replicas} == {16}
    assert all(t.link_seconds("intra") == 0 for t in replicas)
    # 8 replica groups share each uplink: a ring over 16 hosts at 400/8 GB/s per flow
    n = -(-MIB // 8) * 4
    assert replicas[0].seconds == pytest.approx(2 * 15 * (5e-6 + n / 16 * 8 / 400e9))
    assert z.memory.shard_group == 8
    assert any("HSDP replica all-reduces" in a for a in z.assumptions)
    # captured on one host there is no replica node: the simulation derives the same ones
    one_host = ExecutionPlan(
        plan.strategy,
        plan.world_size,
        plan.backend,
        tuple(n for n in plan.nodes if not n.id.endswith(".replicas")),
        (),
        replicate_axis=plan.replicate_axis,
    )
    assert predict(one_host, c).per_step == z.per_step


def test_the_report_names_phases_links_and_assumptions() -> None:
    z = predict(zero3_plan({"(root)": MIB, "blocks.0": 4 * MIB}), cluster())
    text = z.report()
    assert "cluster: 512 x 8: 512 host(s) x 8 device(s) = 4096 devices" in text
    assert "per step by kind, phase and link class:" in text
    assert "all_gather     all-gather            inter" in text
    assert "per step: " in text and "ms of communication (intra" in text
    assert "memory per rank (zero3, sharded over 4,096" in text
    assert "no overlap with compute" in text
    data = z.to_json()
    assert data["per_step"]["seconds"] == pytest.approx(z.total_s)
    assert data["simulated_world_size"] == 4096 and len(data["collectives"]) == 5
    json.dumps(data)


# -- memory ---------------------------------------------------------------------------------


def test_zero3_state_is_dps_divided_by_the_group_up_to_the_gathered_units() -> None:
    units = {"(root)": 5_000_000, "blocks.0": 7_000_000, "blocks.1": 7_000_001}
    c = cluster()
    dp = predict(dp_plan(list(units.values())), c).memory
    z3 = predict(zero3_plan(units), c).memory
    psi = sum(units.values())
    assert (dp.shard_group, dp.param_elements, dp.local_elements) == (1, psi, psi)
    assert (dp.parameters, dp.gradients, dp.optimizer_state) == (4 * psi, 4 * psi, 8 * psi)
    assert dp.state == 16 * psi and dp.gathered_bytes == 0 and dp.peak == dp.state
    n = 4096
    assert z3.shard_group == n and z3.param_elements == psi
    assert z3.local_elements == sum(math.ceil(u / n) for u in units.values())
    assert dp.state / n <= z3.state <= dp.state / n + 16 * len(units)  # ceil per unit
    # gathered: the whole-forward root, plus the largest other unit; parameters + gradient
    assert z3.gathered_bytes == 8 * 5_000_000 + 8 * 7_000_001
    assert z3.peak == z3.state + z3.gathered_bytes
    rows = {what: formula for what, _, formula in z3.rows()}
    assert rows["model state"].startswith("(P + G + K) x S, S = sum ceil(n_u / 4,096)")
    assert "largest other unit blocks.1" in rows["gathered units"]


def test_memory_against_device_memory_and_a_plan_without_gradients() -> None:
    fits = predict(dp_plan([10 * MIB]), cluster()).report()
    assert "device memory 80 GiB:" in fits and "(fits;" in fits
    huge = predict(dp_plan([2**31]), cluster(device_memory_gib=16)).report()
    assert "DOES NOT FIT" in huge
    empty = ExecutionPlan(
        "dp", 1, "cpu", (PlanNode("forward", "forward", "forward", "f", Compute()),), ()
    )
    with pytest.raises(ConfigError, match="capture it on 2 or more ranks"):
        predict(empty, cluster())


# -- the command ----------------------------------------------------------------------------

TINY_SCRIPT = """
import torch
from torch import nn
import lamina

lamina.init()
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
model = lamina.distribute(model, "dp", example_inputs=(torch.randn(4, 64),))
model(torch.randn(4, 64)).sum().backward()
lamina.shutdown()
"""


@pytest.mark.timeout(180)
def test_lamina_plan_simulate_prints_the_report(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(TINY_SCRIPT)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(BIG))
    result = run_lamina("plan", "--simulate", str(path), str(script), env={"LAMINA_BACKEND": "cpu"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"lamina plan --simulate {path}: {script}"
    assert lines[1].startswith("cluster: 512 x 8: 512 host(s) x 8 device(s) = 4096 devices")
    assert "plan: dp, captured on 2 local rank(s); simulated on 4096 rank(s)" in lines
    psi = 64 * 256 + 256 + 256 * 8 + 8
    table = [line for line in lines if line.strip().startswith("bucket")]
    assert table and all("all_reduce" in line for line in table)
    assert any(line.startswith("per step: ") and "ms of communication" in line for line in lines)
    assert any(line.startswith("once at wrap time: ") for line in lines)
    assert "memory per rank (dp, replicated; activations not counted):" in lines
    state = next(line for line in lines if line.strip().startswith("model state"))
    assert "(P + G + K) x Psi" in state
    psi_seen = int(state.split("Psi = ")[1].replace(",", ""))
    assert psi <= psi_seen < psi + 4 * 128  # alignment padding of the bucket slots
    assert "assumptions:" in lines


def test_every_simulated_world_fits_the_limit() -> None:
    assert MAX_DEVICES == 4096
    assert cluster(hosts=4096, devices_per_host=1).world_size == 4096
