"""A declared cluster's ranking priced from plans made at the cluster's size
(:mod:`lamina.auto.cluster_plans`): the planning processes stand as ranks of the cluster
on torch's fake process group (through the rank runner, as ``lamina plan --simulate
CLUSTER --auto`` starts them), and every candidate's price is made of exactly the
collectives its plan there issues, on the cluster's groups; slow links choose the
pipeline and fast ones data parallelism, context and expert parallelism are priced by
their own collectives, and bad plan folders are one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lamina.auto.candidates import candidates_for
from lamina.auto.cluster_plans import (
    PLANS_FILE,
    ClusterPlans,
    planning_ranks,
    price_on_cluster,
    read_candidate_plans,
    with_default_mesh,
)
from lamina.auto.comm import ClusterComm
from lamina.auto.measure import ModelProfile, profile_model
from lamina.auto.ranking import Ranking, rank_candidates
from lamina.errors import ConfigError
from lamina.simulate import cluster_from_dict
from lamina.simulate.cluster import Cluster
from models_for_tests import GPT, GPTConfig
from plans_for_tests import issued

TESTS = Path(__file__).resolve().parent
#: The GPT planned: 4 blocks of width 128 (8 heads, so 8 tp ranks divide them), a
#: 2048-token vocabulary: 4.6 MB of parameters against 2 rows of 16 tokens a rank.
VOCAB, SEQ, WIDTH, ROWS = 2048, 16, 128, 2

GPT_SCRIPT = f"""
import torch
import lamina
from models_for_tests import GPT, GPTConfig
from plans_for_tests import issued

lamina.init()
torch.manual_seed(0)
model = GPT(GPTConfig({VOCAB}, {SEQ}, {WIDTH}, 4, 8))
ids = torch.randint(0, {VOCAB}, ({ROWS}, {SEQ}), generator=torch.Generator().manual_seed(0))
lamina.distribute(model, "auto", example_inputs=(ids,))
"""

MOE_SCRIPT = """
import torch
import lamina
from modern_models import mixtral

lamina.init()
ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
lamina.distribute(mixtral(), "auto", example_inputs=(ids,))
"""


def _spec(hosts: int, per_host: int, gbps: float, memory_gib: float = 80) -> dict[str, Any]:
    return {
        "hosts": hosts,
        "devices_per_host": per_host,
        "intra": {"bandwidth_gbps": 300, "latency_us": 3},
        "inter": {"bandwidth_gbps": gbps, "latency_us": 10},
        "device_memory_gib": memory_gib,
    }


def _cluster(gbps: float, hosts: int = 2, per_host: int = 8, memory_gib: float = 80) -> Cluster:
    """The cluster with its default mesh (inter x intra), as the ranking takes it."""
    return with_default_mesh(
        cluster_from_dict(_spec(hosts, per_host, gbps, memory_gib), "cluster.json")
    )


def _plan(tmp: Path, script: str, cluster: Cluster) -> Path:
    """Every candidate planned as each planning rank of ``cluster`` (at once, one
    process each, through the rank runner): the plans folder."""
    (tmp / "script.py").write_text(script)
    spec = tmp / "cluster.json"
    spec.write_text(json.dumps(_spec(cluster.hosts, cluster.devices_per_host, 1)))
    env = {**os.environ, "LAMINA_BACKEND": "cpu", "PYTHONPATH": str(TESTS)}
    folder = tmp / "plans"
    runner = [
        sys.executable, "-m", "lamina.cli.rank_runner", "--stop", "plan",
        "--out", str(folder), "--auto", "--cluster", str(spec),
    ]  # fmt: skip
    running = [
        subprocess.Popen(
            [*runner, "--as-cluster-rank", str(rank), str(tmp / "script.py")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in planning_ranks(cluster.world_size)
    ]
    for process in running:
        out, _ = process.communicate(timeout=240)
        assert process.returncode == 0, out[-3000:]
    return folder


def _gpt_profile() -> tuple[ModelProfile, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(VOCAB, SEQ, WIDTH, 4, 8))
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    return profile_model(model, (ids,), runs=2), ROWS


def _ranked(
    plans: ClusterPlans, cluster: Cluster, profile: ModelProfile, rows: int, **kw: Any
) -> Ranking:
    comm = ClusterComm(cluster)
    global_rows = rows * cluster.world_size
    return rank_candidates(
        candidates_for(plans.mesh, context=True, experts=True),
        profile,
        lambda c: price_on_cluster(c, plans, profile, comm, global_rows),
        device_memory=cluster.device_memory_bytes,
        global_rows=global_rows,
        **kw,
    )


@pytest.fixture(scope="module")
def gpt_plans(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelProfile, int]:
    folder = _plan(tmp_path_factory.mktemp("gpt"), GPT_SCRIPT, _cluster(25))
    profile, rows = _gpt_profile()
    return folder, profile, rows


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_candidate_is_priced_from_its_plan_at_the_clusters_size(
    gpt_plans: tuple[Path, ModelProfile, int],
) -> None:
    folder, profile, rows = gpt_plans
    cluster = _cluster(25)
    plans = read_candidate_plans(folder, cluster)
    assert sorted(plans.by_rank) == [0, 15]
    ranking = _ranked(plans, cluster, profile, rows)
    priced = {e.candidate.label: e for e in ranking.entries if e.prediction is not None}
    assert {"dp", "zero3", "hsdp", "tp(intra)+zero3(inter)", "pp(inter)+dp(intra)"} <= set(priced)
    params = sum(p.numel() for p in GPT(GPTConfig(VOCAB, SEQ, WIDTH, 4, 8)).parameters())
    for label, entry in priced.items():
        assert entry.prediction is not None
        # the slowest planning rank's step: exactly what its plan there issues
        slowest = max(
            plans.of(label),
            key=lambda p: (
                price_on_cluster(
                    entry.candidate,
                    ClusterPlans(plans.world_size, plans.mesh, {0: {label: p}}),
                    profile,
                    ClusterComm(cluster),
                    rows * 16,
                ).step_s
            ),
        )
        got = sorted((c.node, c.op, c.axis, c.nbytes) for c in entry.prediction.collectives)
        assert got == issued(slowest.plan), label
    # planned on 16 ranks: zero3's shard is a sixteenth, hsdp's an eighth (per host)
    zero3 = plans.of("zero3")[0]
    hsdp = plans.of("hsdp")[0]
    assert zero3.held_numel == pytest.approx(params / 16, rel=0.02)
    assert hsdp.held_numel == pytest.approx(params / 8, rel=0.02)
    axes = {c.axis for c in priced["hsdp"].prediction.collectives}  # type: ignore[union-attr]
    assert axes == {"intra", "inter"}  # shards inside a host, replicas across
    # a pipeline's stages computed as this process measured the model: the busier of its
    # 2 stages does at least half, at most all, of 2 ranks' forward and backward (the
    # planning processes' own cold, shared-core timing only splits it)
    pipelined = priced["pp(inter)+dp(intra)"].prediction
    assert pipelined is not None
    work = profile.forward_s + profile.backward_s
    assert work <= pipelined.parts["compute"] <= 2 * work * 1.01, (pipelined.parts, work)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_slow_links_favour_the_pipeline_and_fast_links_data_parallelism(
    gpt_plans: tuple[Path, ModelProfile, int],
) -> None:
    folder, profile, rows = gpt_plans
    slow, fast = _cluster(0.025), _cluster(100)  # 200 Mbit/s against 800 Gbit/s
    # the plans do not depend on the links: the same plans, priced on each
    by_slow = _ranked(read_candidate_plans(folder, slow), slow, profile, rows)
    by_fast = _ranked(read_candidate_plans(folder, fast), fast, profile, rows)
    slow_labels = [e.candidate.label for e in by_slow.entries]
    fast_labels = [e.candidate.label for e in by_fast.entries]
    assert slow_labels[0].startswith("pp(inter)"), by_slow.table()
    assert fast_labels[0] in ("dp", "zero3", "hsdp"), by_fast.table()
    assert fast_labels.index("pp(inter)+dp(intra)") > fast_labels.index("dp")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_model_that_fits_nowhere_is_one_line_naming_the_smallest_footprint(
    gpt_plans: tuple[Path, ModelProfile, int],
) -> None:
    folder, profile, rows = gpt_plans
    cluster = _cluster(25, memory_gib=0.001)
    ranking = _ranked(read_candidate_plans(folder, cluster), cluster, profile, rows)
    assert ranking.chosen is None
    assert all(e.rejected.startswith(("needs ", "not applicable: ")) for e in ranking.entries), (
        ranking.table()
    )
    with pytest.raises(ConfigError) as error:
        ranking.choice()
    message = str(error.value)
    assert "\n" not in message
    assert "against 1.0 MiB of device memory" in message, message


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_context_parallelism_is_priced_by_its_ring_on_the_cp_group(
    gpt_plans: tuple[Path, ModelProfile, int],
) -> None:
    folder, profile, rows = gpt_plans
    cluster = _cluster(25)
    plans = read_candidate_plans(folder, cluster)
    (cp,) = [c for c in candidates_for(plans.mesh, context=True) if c.cp_degree > 1]
    priced = price_on_cluster(cp, plans, profile, ClusterComm(cluster), rows * 16)
    plan = plans.of(cp.label)[0].plan  # each planning rank sends as many, as large
    # its attention calls pass keys and values around the ring inside each host: every
    # send of the plan priced, each holding up the layer that issues it
    sends = [c for c in priced.collectives if c.op == "send"]
    planned = [n for n in plan.nodes if n.kind == "send"]
    assert len(sends) == len(planned) > 0
    assert {c.axis for c in sends} == {"intra"} and all(c.blocking for c in sends)
    assert sorted(c.nbytes for c in sends) == sorted(n.detail.nbytes for n in planned)
    held_up = sum(c.seconds for c in priced.collectives if c.blocking)
    assert priced.parts["blocking collectives"] == pytest.approx(held_up)
    assert held_up > sum(c.seconds for c in sends) > 0  # and the outputs gathered


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_expert_parallelism_is_priced_by_its_exchanges_on_the_ep_axis(tmp_path: Path) -> None:
    from modern_models import mixtral

    cluster = _cluster(2, hosts=2, per_host=4)  # hosts joined at 2 GB/s
    plans = read_candidate_plans(_plan(tmp_path, MOE_SCRIPT, cluster), cluster)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    profile = profile_model(mixtral(), (ids,), runs=2)
    ranking = _ranked(plans, cluster, profile, 2)
    found = {e.candidate.label: e for e in ranking.entries}
    across = found["ep(inter)+zero3(intra)"].prediction
    assert across is not None, found["ep(inter)+zero3(intra)"].rejected
    exchanges = [c for c in across.collectives if c.op == "all_to_all"]
    assert exchanges and {c.axis for c in exchanges} == {"inter"}
    # two layers, tokens out to the experts and back, forward and backward
    assert len(exchanges) >= 2 * 4
    assert all(c.blocking for c in exchanges)


def test_a_missing_or_foreign_plans_folder_is_one_line_naming_the_file(tmp_path: Path) -> None:
    cluster = _cluster(25)
    with pytest.raises(ConfigError) as missing:
        read_candidate_plans(tmp_path, cluster)
    message = str(missing.value)
    assert "\n" not in message
    assert str(tmp_path / PLANS_FILE.format(rank=0)) in message
    assert "rerun lamina plan --simulate CLUSTER --auto" in message
    for rank in (0, 15):
        (tmp_path / PLANS_FILE.format(rank=rank)).write_text(
            '{"version": 1, "world_size": 8, "mesh": [["dp", 8]], "candidates": {}}'
        )
    with pytest.raises(ConfigError, match=r"made for mesh \{'dp': 8\} of 8 ranks, not"):
        read_candidate_plans(tmp_path, cluster)
