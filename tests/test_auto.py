"""``lamina.distribute(model, "auto")``: the candidates of a mesh, their predicted step
times and memory on a declared cluster, the choice made alike on every rank and recorded
in the plan, the one-line error for a model that fits nowhere, ``lamina plan --auto``
(on the job and on a declared 4096-device cluster), and the GPT example trained by the
automatic choice as by the same strategy given by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lamina
from examples_on_ranks import run_example
from lamina.auto.attention import AttentionCall, AttentionProfile
from lamina.auto.candidates import candidates_for
from lamina.auto.choose import distribute_candidate
from lamina.auto.experts import ExpertLayer, ExpertProfile
from lamina.auto.measure import ChainProfile, ModelProfile
from lamina.auto.predict import NotApplicable, predict_memory
from lamina.errors import ConfigError
from lamina.simulate import cluster_from_dict
from lamina.strategies.pp.chain import BlockChain
from lamina.strategies.pp.cut import BlockCosts
from lamina.testing import run_ranks
from lamina.testing.cli import run_lamina
from models_for_tests import GPT, GPTConfig
from plans_for_tests import issued

# -- candidates ----------------------------------------------------------------------------


def test_a_flat_mesh_offers_every_strategy_over_all_ranks() -> None:
    labels = [c.label for c in candidates_for({"dp": 4})]
    assert labels == ["dp", "zero3", "tp", "pp"]
    assert [c.label for c in candidates_for({"dp": 1})] == ["dp"]


def test_a_two_axis_mesh_keeps_growing_traffic_inside_hosts() -> None:
    found = {c.label: c for c in candidates_for({"inter": 2, "intra": 4})}
    assert list(found) == [
        "dp",
        "zero3",
        "hsdp",
        "tp(intra)+zero3(inter)",
        "pp(inter)+dp(intra)",
        "pp(inter)+zero3(intra)",
    ]
    tp = found["tp(intra)+zero3(inter)"]
    assert (tp.tp_degree, tp.shard_degree, tp.data_replicas) == (4, 2, 2)
    pp = found["pp(inter)+dp(intra)"]
    assert (pp.pp_degree, pp.data_replicas, pp.microbatches) == (2, 4, 4)
    assert pp.sync_axes() == ("intra",)


def test_lossy_codecs_are_candidates_only_when_allowed() -> None:
    assert not [c for c in candidates_for({"dp": 2}) if c.codec]
    lossy = [c.label for c in candidates_for({"dp": 2}, allow_lossy=True) if c.codec]
    assert lossy == ["dp+bf16", "dp+fp8"]


def test_axes_of_one_rank_go_to_the_replicating_strategy() -> None:
    found = {c.label: c for c in candidates_for({"inter": 1, "intra": 2})}
    assert list(found) == ["dp", "zero3", "pp"]  # tp alone cannot place the other axis
    assert found["pp"].uses[0].replicate == ("inter",)


def test_a_three_axis_mesh_places_tp_and_pp_on_their_named_axes() -> None:
    labels = [c.label for c in candidates_for({"pp": 4, "dp": 128, "tp": 8})]
    assert labels == [
        "dp",
        "zero3",
        "tp(tp)+zero3(pp+dp)",
        "pp(pp)+dp(dp+tp)",
        "pp(pp)+zero3(dp+tp)",
    ]


def test_context_parallelism_is_a_candidate_only_when_asked_for() -> None:
    assert not [c for c in candidates_for({"dp": 4}) if c.cp_degree > 1]
    flat = [c for c in candidates_for({"dp": 4}, context=True) if c.cp_degree > 1]
    assert [c.label for c in flat] == ["cp+zero3"]
    assert (flat[0].cp_degree, flat[0].shard_degree, flat[0].data_replicas) == (4, 4, 1)
    two = [c for c in candidates_for({"inter": 2, "intra": 4}, context=True) if c.cp_degree > 1]
    assert [c.label for c in two] == ["cp(intra)+zero3(inter+intra)"]
    assert two[0].batch_axes() == ("inter",) and two[0].data_replicas == 2
    named = candidates_for({"dp": 2, "cp": 4, "tp": 2}, context=True)
    assert "cp(cp)+zero3(dp+cp+tp)" in [c.label for c in named]


# -- predictions on a declared cluster -------------------------------------------------------

BLOCKS = 8


def _profile(width: int = 1024, rows: int = 8, seconds_per_block: float = 0.004) -> ModelProfile:
    """A transformer-like profile: 8 blocks of 12 w^2 parameters, tied embedding and head."""
    block = 12 * width * width * 4
    embedding = 32_000 * width * 4
    chain = BlockChain(
        "blocks",
        tuple(f"blocks.{i}" for i in range(BLOCKS)),
        ("tok",),
        ("head",),
        tuple((rows // 2, 256, width) for _ in range(BLOCKS)),
        torch.float32,
    )
    costs = BlockCosts(tuple(seconds_per_block for _ in range(BLOCKS)), seconds_per_block)
    profile_chain = ChainProfile(
        chain,
        rows // 2,
        costs,
        tuple(block for _ in range(BLOCKS)),
        embedding,
        embedding,
        256 * width * 4,
    )
    total = BLOCKS * block + embedding
    compute = 2 * (BLOCKS + 1) * seconds_per_block
    return ModelProfile(
        batch=rows,
        parameters=total // 4,
        parameter_bytes=total,
        tied_bytes=embedding,
        forward_s=compute / 3,
        backward_s=2 * compute / 3,
        optimizer_s=total / 4 * 2e-10,
        activation_bytes=rows * 256 * width * 4 * 20 * BLOCKS,
        chain=profile_chain,
    )


def _cluster(gbps: float, hosts: int = 2, per_host: int = 8, memory_gib: float = 80) -> Any:
    return cluster_from_dict(
        {
            "hosts": hosts,
            "devices_per_host": per_host,
            "intra": {"bandwidth_gbps": 300, "latency_us": 3},
            "inter": {"bandwidth_gbps": gbps, "latency_us": 10},
            "device_memory_gib": memory_gib,
            "mesh": {"inter": hosts, "intra": per_host},
        }
    )


def test_sharding_divides_the_state_and_a_pipeline_holds_one_stage() -> None:
    cluster = _cluster(25)
    profile = _profile()
    by = {c.label: predict_memory(c, profile) for c in candidates_for(cluster.mesh)}
    state = {label: p.memory_parts["state"] for label, p in by.items()}
    assert state["dp"] == 4 * profile.parameter_bytes
    assert state["zero3"] == state["dp"] // 16
    assert state["hsdp"] == state["dp"] // 8
    assert state["pp(inter)+dp(intra)"] < state["dp"] // 2 + 4 * 2 * 32_000 * 1024 * 4


def test_a_model_without_blocks_cannot_be_pipelined_or_split() -> None:
    profile = _profile()
    flat = ModelProfile(**{**profile.__dict__, "chain": None, "no_chain": "no list of blocks"})
    cluster = _cluster(25)
    for candidate in candidates_for(cluster.mesh):
        if {"pp", "tp"} & set(candidate.strategies):
            with pytest.raises(NotApplicable, match="no list of blocks"):
                predict_memory(candidate, flat)


def _long_profile(tokens: int, rows: int = 1) -> ModelProfile:
    """The transformer profile on ``rows`` sequences of ``tokens`` (its compute and
    activations grown with the tokens), with 8 attention calls of 32 query and 8
    key/value heads of dim 128 (grouped-query, causal)."""
    base = _profile(rows=rows)
    assert base.chain is not None
    scale = tokens / 256
    calls = tuple(AttentionCall(rows, 32, 8, tokens, 128, 4, True) for _ in range(BLOCKS))
    chain = ChainProfile(**{**base.chain.__dict__, "crossing_bytes_per_row": tokens * 1024 * 4})
    return ModelProfile(
        **{
            **base.__dict__,
            "forward_s": base.forward_s * scale,
            "backward_s": base.backward_s * scale,
            "activation_bytes": int(base.activation_bytes * scale),
            "chain": chain,
            # the forward returns the last hidden states (the loss taken on them outside)
            "attention": AttentionProfile(rows, calls, rows * tokens * 1024 * 4),
        }
    )


def test_context_parallelism_holds_one_calls_gathered_keys_and_values() -> None:
    cluster = _cluster(25, hosts=1, per_host=8)
    profile = _long_profile(32_768)  # one row per rank: the cp group holds 8
    (cp,) = [c for c in candidates_for(cluster.mesh, context=True) if c.cp_degree > 1]
    zero3 = next(c for c in candidates_for(cluster.mesh) if c.label == "zero3")
    split, whole = predict_memory(cp, profile), predict_memory(zero3, profile)
    kv = 2 * 8 * 8 * 32_768 * 128 * 4  # one call's keys and values on the group's 8 rows
    assert split.memory_parts["gathered keys and values"] == kv
    assert split.memory_parts["state"] == whole.memory_parts["state"]
    assert split.memory_bytes > whole.memory_bytes + kv
    odd = _long_profile(32_760)
    with pytest.raises(NotApplicable, match="32760 tokens does not split into 16 equal chunks"):
        predict_memory(cp, odd)


def test_a_global_batch_of_fewer_rows_than_ranks_is_split_by_context_or_tensor() -> None:
    # one 32k-token sequence per step on 2 hosts of 8 devices: data parallelism has no
    # row for most ranks; cp splits the sequence, tp the layers
    cluster = _cluster(25)
    found = {c.label: c for c in candidates_for(cluster.mesh, context=True)}
    profile = _long_profile(32_768)
    with pytest.raises(
        NotApplicable, match="its 16 data replicas cannot share a global batch of 2 rows"
    ):
        predict_memory(found["dp"], profile, global_rows=2)
    for label in ("cp(intra)+zero3(inter+intra)", "tp(intra)+zero3(inter)"):
        assert predict_memory(found[label], profile, global_rows=2).memory_bytes > 0


def test_expert_parallelism_is_a_candidate_only_when_asked_for() -> None:
    assert all(c.ep_degree == 1 for c in candidates_for({"dp": 4}))
    flat = [c for c in candidates_for({"dp": 4}, experts=True) if c.ep_degree > 1]
    assert [c.label for c in flat] == ["ep"]
    two = [c for c in candidates_for({"inter": 2, "intra": 4}, experts=True) if c.ep_degree > 1]
    assert [c.label for c in two] == ["ep(intra)+zero3(inter)", "ep(inter)+zero3(intra)"]
    # ep is a data axis: every rank takes its own rows
    assert [(c.ep_degree, c.shard_degree, c.data_replicas) for c in two] == [(4, 2, 8), (2, 4, 8)]
    named = candidates_for({"dp": 2, "ep": 4, "tp": 2}, experts=True)
    assert "ep(ep)+zero3(dp+tp)" in [c.label for c in named]


def _moe_profile(experts: int = 8, share: float = 0.9) -> ModelProfile:
    """The transformer profile on 2 rows with an MoE layer in each block: ``experts``
    experts holding ``share`` of the parameters, top-2 of 256 tokens a row, width 1024."""
    base = _profile(rows=2)
    exchange = base.batch * 256 * 2 * 1024 * 4
    layers = tuple(ExpertLayer(experts, int(exchange)) for _ in range(BLOCKS))
    moe = ExpertProfile(int(base.batch), layers, int(base.parameter_bytes * share))
    return ModelProfile(**{**base.__dict__, "experts": moe})


def test_expert_parallelism_holds_its_share_of_the_experts() -> None:
    cluster = _cluster(2)
    profile = _moe_profile()
    found = {c.label: c for c in candidates_for(cluster.mesh, experts=True)}
    across = predict_memory(found["ep(inter)+zero3(intra)"], profile)
    # each rank holds the dense tenth and half the experts, sharded 8 ways inside its host
    held = profile.parameter_bytes * (0.1 + 0.9 / 2) / 8
    assert across.memory_parts["state"] == pytest.approx(held * 4, rel=1e-6)
    one = profile.experts.layers[0].exchange_bytes  # type: ignore[union-attr]
    assert across.memory_parts["exchanged tokens"] == 2 * one
    # 8 experts do not split over the 3 ranks of an axis
    odd = [c for c in candidates_for({"dp": 3}, experts=True) if c.ep_degree > 1]
    with pytest.raises(NotApplicable, match="8 experts do not split over ep=3"):
        predict_memory(odd[0], _moe_profile())


def test_the_profile_reads_a_transformers_moe_models_experts() -> None:
    from lamina.auto.measure import profile_model
    from modern_models import mixtral

    model = mixtral(experts=8)
    x = torch.randint(0, 64, (2, 16))
    profile = profile_model(model, (x,), runs=1)
    moe = profile.experts
    assert moe is not None and moe.rows == 2
    assert [layer.experts for layer in moe.layers] == [8, 8]
    # every token's top-2 assignments, each a hidden vector of 32 floats
    assert [layer.exchange_bytes for layer in moe.layers] == [2 * 16 * 2 * 32 * 4] * 2
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    assert moe.expert_bytes == experts
    dense = nn.Sequential(nn.Linear(8, 8))
    assert profile_model(dense, (torch.randn(2, 8),), runs=1).experts is None


# -- on ranks --------------------------------------------------------------------------------

VOCAB, SEQ, ROWS = 64, 32, 8


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(VOCAB, SEQ, 32, 4, 4))


def _auto_job() -> dict[str, Any]:
    runtime = lamina.init()
    torch.set_num_threads(1)
    ids = torch.randint(
        0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(runtime.rank)
    )
    model = lamina.distribute(_gpt(), "auto", example_inputs=(ids,), timing_runs=2)
    choice = model.lamina_auto  # type: ignore[union-attr]
    meta = dict(model.execution_plan.meta)  # type: ignore[union-attr]
    if choice.candidate.pp_degree > 1:
        model.step(ids, ids, lambda out, y: out.float().mean())  # type: ignore[operator]
    else:
        model(ids).float().mean().backward()
    summary = model.step_summary()  # type: ignore[operator]
    priced, planned = {}, {}
    for entry in choice.ranking.entries:  # each candidate as given by hand: its real plan
        assert entry.prediction is not None
        priced[entry.candidate.label] = sorted(
            (c.node, c.op, c.axis, c.nbytes) for c in entry.prediction.collectives
        )
        built = distribute_candidate(lamina.distribute, _gpt(), entry.candidate, (ids,))
        if built.execution_plan is None:  # dp plans at its first forward
            built(ids)
        planned[entry.candidate.label] = issued(built.execution_plan)  # type: ignore[arg-type]
    try:
        lamina.distribute(
            _gpt(), "auto", example_inputs=(ids,), device_memory=1 << 16, timing_runs=1
        )
        too_big = ""
    except ConfigError as exc:
        too_big = str(exc)
    lamina.shutdown()
    return {
        "priced": priced,
        "planned": planned,
        "chosen": choice.candidate.label,
        "strategy": choice.strategy,
        "ranked": [e.candidate.label for e in choice.ranking.entries],
        "meta_auto": meta.get("auto", ""),
        "meta_ranking": json.loads(meta.get("auto_ranking", "{}")),
        "summary": summary,
        "replica": choice.replica,
        "too_big": too_big,
    }


@pytest.mark.multiprocess
def test_every_rank_chooses_alike_and_the_plan_and_run_log_record_it() -> None:
    results = run_ranks(_auto_job, 2, timeout=300)
    first = results[0]
    # every candidate's step was priced from exactly the collectives its plan issues
    assert set(first["priced"]) == {"dp", "zero3", "tp", "pp"}
    for label, planned in first["planned"].items():
        assert [tuple(c) for c in first["priced"][label]] == [tuple(c) for c in planned], label
    assert len(first["planned"]["tp"]) > 20  # every layer's activation collectives
    assert all(r["chosen"] == first["chosen"] and r["ranked"] == first["ranked"] for r in results)
    assert first["ranked"][0] == first["chosen"]
    assert set(first["ranked"]) == {"dp", "zero3", "tp", "pp"}
    assert first["meta_auto"].startswith(f"{first['chosen']} (predicted ")
    assert first["meta_ranking"]["chosen"] == first["chosen"]
    assert f"auto chose {first['chosen']}" in first["summary"]
    replicas = {tuple(r["replica"]) for r in results}
    assert len(replicas) == (2 if first["chosen"] in ("dp", "zero3") else 1)
    message = first["too_big"]
    assert "\n" not in message
    assert re.search(
        r"the smallest predicted footprint is [\d.]+ [KM]iB per rank \(\w+\) against 64\.0 KiB "
        r"of device memory",
        message,
    ), message


AUTO_SCRIPT = """
import torch
import lamina
from torch import nn

lamina.init()
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)])
model = lamina.distribute(model, "dp", example_inputs=(torch.randn(8, 64),))
model(torch.randn(8, 64)).sum().backward()
lamina.shutdown()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_lamina_plan_auto_prints_the_ranking_then_the_chosen_plan(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(AUTO_SCRIPT)  # names "dp": --auto chooses instead
    result = run_lamina(
        "plan",
        "--auto",
        "--nproc-per-node",
        "2",
        str(script),
        env={"LAMINA_BACKEND": "cpu"},
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"lamina plan --auto: {script}"
    assert lines[1].split() == ["#", "candidate", "step", "ms", "interval", "memory", "verdict"]
    rows = lines[2:6]
    assert rows[0].split()[1] and rows[0].endswith("chosen")
    for row in rows:  # each step with the interval the measured spread gives
        step, interval = row.split()[2:4]
        low, high = (float(v) for v in interval.split("-"))
        assert low <= float(step) <= high, row
    assert sorted(r.split()[1] for r in rows) == ["dp", "pp", "tp", "zero3"]
    assert any("x the chosen" in r for r in rows)
    assert lines[6].startswith("device memory ") and "links: timed on this job" in lines[6]
    chosen = rows[0].split()[1]
    assert f"the chosen plan ({chosen}):" in lines


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_lamina_plan_simulate_auto_ranks_a_4096_device_cluster(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(AUTO_SCRIPT)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps(
            {
                "hosts": 512,
                "devices_per_host": 8,
                "intra": {"bandwidth_gbps": 300, "latency_us": 3},
                "inter": {"bandwidth_gbps": 25, "latency_us": 10},
                "device_memory_gib": 80,
                "mesh": {"pp": 4, "dp": 128, "tp": 8},
            }
        )
    )
    result = run_lamina(
        "plan", "--simulate", str(cluster), "--auto", "--json", str(script),
        env={"LAMINA_BACKEND": "cpu"}, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranking = json.loads(result.stdout)["ranking"]
    labels = [c["label"] for c in ranking["candidates"]]
    assert sorted(labels) == sorted(
        ["dp", "zero3", "tp(tp)+zero3(pp+dp)", "pp(pp)+dp(dp+tp)", "pp(pp)+zero3(dp+tp)"]
    )
    assert ranking["chosen"] == labels[0]
    assert ranking["device_memory"] == 80 * 2**30
    assert "4096 devices" in ranking["where"]


# -- the example -------------------------------------------------------------------------------

HAND = {"dp": ["--strategy", "dp"], "zero3": ["--strategy", "zero3"]}


@pytest.mark.multiprocess
def test_train_gpt_auto_trains_as_the_chosen_strategy_given_by_hand(tmp_path: Path) -> None:
    tiny = [
        "--max-steps", "6", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "4",
        "--seq-len", "32", "--d-model", "32", "--n-layers", "2", "--corpus-mb", "0.2",
    ]  # fmt: skip
    auto = run_example(
        "train_gpt.py", *tiny, "--strategy", "auto", "--metrics", str(tmp_path / "a")
    )
    assert auto.returncode == 0, auto.stderr[-3000:]
    chosen = re.search(r"strategy 'auto' chose (\S+) ", auto.stderr)
    assert chosen, auto.stderr[-2000:]
    label = chosen.group(1)
    if label.startswith("pp"):  # 2 stages, 4 microbatches, one pipeline's rows
        by_hand = ["--strategy", "pp", "--pp-microbatches", "4", "--batch-size", "8"]
    else:
        assert label in HAND, f"auto chose {label}, which train_gpt.py has no flag for"
        by_hand = HAND[label]
    hand_args = [a for a in tiny if a != "4"] if "--batch-size" in by_hand else tiny
    if "--batch-size" in by_hand:
        hand_args = [*tiny[: tiny.index("--batch-size")], *tiny[tiny.index("--batch-size") + 2 :]]
    hand = run_example("train_gpt.py", *hand_args, *by_hand, "--metrics", str(tmp_path / "h"))
    assert hand.returncode == 0, hand.stderr[-3000:]
    curves = [
        [json.loads(line)["train_loss"] for line in (tmp_path / name).read_text().splitlines()]
        for name in ("a", "h")
    ]
    assert len(curves[0]) == 3
    assert curves[0] == pytest.approx(curves[1], rel=1e-6)


# -- a sequence split by the automatic choice ---------------------------------------------------

LONG = 64


class _OneAttention(nn.Module):
    """An embedding, one causal attention of 4 heads and a head: no chain of blocks (no
    tp, no pp), so one sequence on two ranks can only be split by cp."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 32)
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape
        q, k, v = self.qkv(self.emb(x)).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h.transpose(1, 2).reshape(b, s, 32))


def _lm(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _one_sequence_job() -> dict[str, Any]:
    lamina.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    xs = torch.randint(0, VOCAB, (3, 1, LONG), generator=g)
    reference = _OneAttention()
    model = lamina.distribute(
        _OneAttention(),
        "auto",
        example_inputs=(xs[0],),
        global_batch=1,
        context_min_tokens=0,
        timing_runs=1,
    )
    choice = model.lamina_auto  # type: ignore[union-attr]
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in xs:
        loss = _lm(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        expected = _lm(reference(x), x)
        expected.backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        losses.append((loss.item(), expected.item()))
    last = model.lamina_cp.run_log.current  # type: ignore[union-attr]
    logged = sorted({*last.issued, *last.transfers})
    try:  # the default minimum: a 64-token sequence is not long enough for cp
        lamina.distribute(
            _OneAttention(), "auto", example_inputs=(xs[0],), global_batch=1, timing_runs=1
        )
        short = ""
    except ConfigError as exc:
        short = str(exc)
    lamina.shutdown()
    return {
        "chosen": choice.candidate.label,
        "verdicts": {e.candidate.label: e.rejected for e in choice.ranking.entries},
        "replica_rows": choice.replica_rows,
        "losses": losses,
        "logged": logged,
        "short": short,
    }


@pytest.mark.multiprocess
def test_one_sequence_on_two_ranks_is_split_by_cp_and_trains_as_one_process() -> None:
    results = run_ranks(_one_sequence_job, 2, timeout=300)
    first = results[0]
    assert all(r["chosen"] == "cp+zero3" for r in results), first["verdicts"]
    assert first["verdicts"]["dp"].endswith("cannot share a global batch of 1 rows")
    assert first["verdicts"]["tp"].startswith("not applicable: tp splits the layers of blocks")
    assert first["replica_rows"] == 1
    for r in results:
        for ours, theirs in r["losses"]:
            assert ours == pytest.approx(theirs, rel=1e-6)
    assert "output.0" in first["logged"]
    assert any(n.startswith("attention.0.") for n in first["logged"]), first["logged"]
    assert "\n" not in first["short"]
    assert first["short"].startswith("strategy 'auto': no candidate can run this model ("), first[
        "short"
    ]
