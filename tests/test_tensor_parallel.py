"""Tensor parallelism (``tp``): the plan derived from the graph, and ``["tp", "zero3"]``
on a 2 x 2 mesh training as one process does."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import lamina
from lamina.errors import ConfigError
from lamina.strategies.tp.activation_ops import TensorGroup
from lamina.strategies.tp.apply import shard_columns, shard_rows
from lamina.strategies.tp.derive import derive_plan
from lamina.strategies.tp.layers import TensorPlan
from lamina.strategies.tp.styles import style_key, torch_styles
from lamina.testing import run_ranks
from models_for_tests import TinyMoE, full_params, tiny_gpt, tiny_llama

VOCAB, BATCH, SEQ = 64, 2, 16


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _torchtitan_llama_plan(layers: int) -> dict[str, ParallelStyle]:
    """The hand-written plan torchtitan gives a Llama, in Hugging Face's module names: the
    sequence split entering the first block (Hugging Face's model reads the embedding's
    output for positions and the mask, so it stays whole until then)."""
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        ),
        "model.layers.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(layers):
        block = f"model.layers.{i}"
        plan |= {
            f"{block}.input_layernorm": SequenceParallel(),
            f"{block}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            f"{block}.self_attn.q_proj": ColwiseParallel(),
            f"{block}.self_attn.k_proj": ColwiseParallel(),
            f"{block}.self_attn.v_proj": ColwiseParallel(),
            f"{block}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{block}.post_attention_layernorm": SequenceParallel(),
            f"{block}.mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            f"{block}.mlp.gate_proj": ColwiseParallel(),
            f"{block}.mlp.up_proj": ColwiseParallel(),
            f"{block}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


def test_the_plan_derived_for_a_llama_is_torchtitans_hand_written_plan() -> None:
    plan = derive_plan(tiny_llama(), (_ids(0),), None, 2, sequence_parallel=True)
    derived = {name: style_key(s) for name, s in torch_styles(plan).items()}
    written = {name: style_key(s) for name, s in _torchtitan_llama_plan(2).items()}
    assert derived == written
    heads = {c.linear.rsplit(".", 1)[1]: c.heads for r in plan.regions for c in r.columns}
    assert heads == {"q_proj": 4, "k_proj": 2, "v_proj": 2, "gate_proj": 0, "up_proj": 0}


def test_the_gpt_plan_splits_the_fused_projection_by_chunks_and_ties_embedding_and_head() -> None:
    plan = derive_plan(tiny_gpt(), (_ids(0),), None, 2, sequence_parallel=False)
    assert plan.columns()["blocks.0.attn.qkv"].chunks == 3
    assert [e.module for e in plan.embeddings] == ["tok"]  # pos is looked up by arange
    assert [h.module for h in plan.heads] == ["head"]
    assert set(plan.rows()) == {f"blocks.{i}.{n}" for i in (0, 1) for n in ("attn.proj", "mlp.2")}


def test_a_norm_over_the_split_features_keeps_a_region_replicated() -> None:
    class NormInside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.up(x)
            return self.down(nn.functional.layer_norm(h, (16,)))

    plan = derive_plan(NormInside(), (torch.randn(2, 4, 8),), None, 2, sequence_parallel=False)
    assert not plan.regions
    assert dict(plan.replicated)["up"].startswith("layer_norm in ")


def test_two_pairs_of_linears_under_one_container_stay_replicated_with_the_fix() -> None:
    """A flat stack of linears pairs into regions whose innermost common module is the
    root for both: neither can gather its input there, so both stay whole (found when
    "auto" first planned tp on such a model: the plan had one node id twice)."""
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)]
    plan = derive_plan(
        nn.Sequential(*blocks), (torch.randn(2, 8),), None, 2, sequence_parallel=False
    )
    assert plan.regions == ()
    reasons = dict(plan.replicated)
    assert set(reasons) == {"0.0", "1.0", "2.0", "3.0"}
    assert "held by the same module (the model itself)" in reasons["0.0"]
    assert "put each column/row pair in a module of its own" in reasons["0.0"]


def test_a_key_value_head_count_tp_does_not_divide_is_one_line_before_any_collective() -> None:
    model = tiny_llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ConfigError) as err:
        derive_plan(model, (_ids(0),), None, 2, sequence_parallel=False)
    message = str(err.value)
    assert "\n" not in message
    assert "model.layers.0.self_attn" in message and "k_proj" in message
    assert "3 heads" in message and "size 2" in message


def test_tp_needs_example_inputs() -> None:
    from lamina.strategies.tp.options import TensorParallelOptions

    with pytest.raises(ConfigError, match="example_inputs"):
        TensorParallelOptions()


def _expected_local(
    plan: TensorPlan, name: str, full: torch.Tensor, tp: TensorGroup
) -> torch.Tensor:
    module, _, attr = name.rpartition(".")
    columns, rows = plan.columns(), plan.rows()
    if module in columns:
        return shard_rows(full, tp, columns[module].parts(int(full.shape[0])))
    if module in rows and attr == "weight":
        return shard_columns(full, tp)
    if module in {e.module for e in plan.embeddings} | {h.module for h in plan.heads}:
        return shard_rows(full, tp)
    return full


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _build(name: str) -> nn.Module:
    if name == "moe":
        return TinyMoE()
    return tiny_gpt() if name == "gpt" else tiny_llama(0)  # llama, llama-given


def _train_once(runtime: Any, name: str, follower: str, sp: bool, optimizer: str) -> dict[str, Any]:
    from _gpt_model import lm_loss

    torch.manual_seed(0)
    reference = _build(name)
    torch.manual_seed(0)
    ours = _build(name)
    if runtime.rank:  # rank-seeded weights: the setup broadcast makes them rank 0's
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(torch.randn_like(p))
    replica = runtime.mesh.coordinates().get("dp", 0) + runtime.mesh.coordinates().get("fsdp", 0)
    replicas = runtime.world_size // runtime.mesh.size("tp")
    xs = [_ids(10 + k) for k in range(5 * replicas)]
    ys = [_ids(100 + k) for k in range(5 * replicas)]
    given = {"plan": _torchtitan_llama_plan(2)} if name == "llama-given" else {}
    ours = lamina.distribute(
        ours, ["tp", follower], example_inputs=(xs[0],), sequence_parallel=sp, **given
    )

    def make(params: Any) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1)
        return torch.optim.AdamW(params, lr=1e-3)

    opt_ref, opt_ours = make(reference.parameters()), make(ours.parameters())
    loss_errors = []
    for step in range(5):
        batch = range(step * replicas, (step + 1) * replicas)
        parts = [lm_loss(_logits(reference, xs[k]), ys[k]) for k in batch]
        (sum(parts) / replicas).backward()
        k = step * replicas + replica
        loss = lm_loss(_logits(ours, xs[k]), ys[k])
        loss.backward()
        for opt in (opt_ref, opt_ours):
            opt.step()
            opt.zero_grad(set_to_none=True)
        want = parts[replica].item()
        loss_errors.append(abs(loss.item() - want) / abs(want))
    tensor_plan = ours.lamina_tp.plan  # type: ignore[union-attr]
    group = ours.lamina_tp.group  # type: ignore[union-attr]
    named = dict(reference.named_parameters())
    diff = max(
        (_expected_local(tensor_plan, n, named[n].detach(), group) - p).abs().max().item()
        for n, p in full_params(ours).items()
    )
    plan = ours.execution_plan  # type: ignore[union-attr]
    axes = sorted({n.collective.axis for n in plan.collectives() if n.collective is not None})
    return {
        "loss": max(loss_errors),
        "params": diff,
        "strategy": plan.strategy,
        "axes": axes,
        "source": tensor_plan.source,
    }


#: Sequence parallelism on and off, SGD and AdamW, on each model.
CASES = [
    ("gpt", True, "adamw"),
    ("gpt", False, "sgd"),
    ("llama", True, "sgd"),
    ("llama", False, "adamw"),
    ("moe", True, "adamw"),
    ("moe", False, "sgd"),
    ("llama-given", True, "adamw"),  # torchtitan's hand-written plan, given
]


def _tp_zero3_job() -> dict[str, Any]:
    runtime = lamina.init(mesh=((2, 2), ("fsdp", "tp")))
    results = {f"{n}/{sp}/{o}": _train_once(runtime, n, "zero3", sp, o) for n, sp, o in CASES}
    lamina.shutdown()
    return results


@pytest.fixture(scope="module")
def tp_zero3_results() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_tp_zero3_job, 4, env=env, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("name", "sp", "optimizer"), CASES)
def test_tp_by_zero3_trains_as_one_process(
    tp_zero3_results: list[dict[str, Any]], name: str, sp: bool, optimizer: str
) -> None:
    for rank, results in enumerate(tp_zero3_results):
        got = results[f"{name}/{sp}/{optimizer}"]
        assert got["loss"] <= 1e-6, (rank, got)
        assert got["params"] <= 1e-5, (rank, got)
        assert got["strategy"] == "tp+zero3"
        assert got["source"] == (
            "given as torch ParallelStyle objects"
            if name == "llama-given"
            else "derived from the captured graph"
        )
        assert got["axes"] == ["fsdp", "tp", "world"]


def test_a_given_plan_that_cannot_run_is_one_line_naming_the_layer() -> None:
    model = tiny_llama()

    def given(plan: dict[str, ParallelStyle]) -> TensorPlan:
        return derive_plan(model, (_ids(0),), None, 2, sequence_parallel=True, given=plan)

    with pytest.raises(ConfigError) as err:  # q split, k and v whole: no row takes it
        given({"model.layers.0.self_attn.q_proj": ColwiseParallel()})
    assert "\n" not in str(err.value) and "model.layers.0.self_attn.q_proj" in str(err.value)
    with pytest.raises(ConfigError, match="does not have"):
        given({"model.nope": ColwiseParallel()})
    swapped = _torchtitan_llama_plan(2)
    swapped["model.layers.0.mlp.down_proj"] = ColwiseParallel()
    with pytest.raises(ConfigError, match=r"down_proj a ColwiseParallel, but its input is already"):
        given(swapped)
    unsplit = _torchtitan_llama_plan(2)
    del unsplit["model.layers.1.mlp.up_proj"], unsplit["model.layers.1.mlp.gate_proj"]
    with pytest.raises(ConfigError, match=r"down_proj a RowwiseParallel, but its input is not"):
        given(unsplit)


def test_the_given_torchtitan_plan_is_the_derived_plan() -> None:
    model = tiny_llama()
    derived = derive_plan(model, (_ids(0),), None, 2, sequence_parallel=True)
    plan = _torchtitan_llama_plan(2)
    given = derive_plan(model, (_ids(0),), None, 2, sequence_parallel=False, given=plan)
    assert given.lines()[1:] == derived.lines()[1:]
    assert given.source == "given as torch ParallelStyle objects" and not given.differences


def test_a_given_plan_that_leaves_layers_whole_runs_as_given_and_says_how_it_differs() -> None:
    model = tiny_llama()
    plan: dict[str, ParallelStyle] = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(2):  # attention left whole, no sequence parallelism
        plan |= {
            f"model.layers.{i}.mlp.gate_proj": ColwiseParallel(),
            f"model.layers.{i}.mlp.up_proj": ColwiseParallel(),
            f"model.layers.{i}.mlp.down_proj": RowwiseParallel(),
        }
    given = derive_plan(model, (_ids(0),), None, 2, sequence_parallel=True, given=plan)
    assert {r.module for r in given.regions} == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert not given.sequence_parallel and not given.embeddings
    assert any(
        d.startswith("model.layers.0.self_attn.q_proj: given whole, derived ColwiseParallel(")
        for d in given.differences
    ), given.differences
    from lamina.runtime import explain
    from lamina.strategies.tp.plan_nodes import build_tensor_plan

    text = explain(build_tensor_plan(given, model, (0, 1), "tp", 2, "gloo"))
    assert "differs from the derived plan: model.layers.0.self_attn.q_proj: given whole" in text


def test_plan_explain_prints_the_layer_plan_and_each_activation_collective() -> None:
    from lamina.runtime import explain
    from lamina.strategies.tp.plan_nodes import build_tensor_plan

    model = tiny_llama()
    layers = derive_plan(model, (_ids(0),), None, 2, sequence_parallel=True)
    text = explain(build_tensor_plan(layers, model, (0, 1), "tp", 4, "gloo"))
    assert "layer plan" in text
    assert "region model.layers.0.self_attn: column model.layers.0.self_attn.q_proj" in text
    assert "tp.model.layers.0.self_attn.o_proj.fwd" in text  # its reduce-scatter
    assert "reduce_scatter" in text and "all_gather" in text


#: tp x HSDP on 2 hosts x 2 ranks: tp inside each host, replicas across the hosts.
HSDP_CASES = [("gpt", True, "adamw"), ("llama", False, "sgd"), ("moe", True, "sgd")]


def _tp_hsdp_job() -> dict[str, Any]:
    runtime = lamina.init(mesh={"dp": 2, "fsdp": 1, "tp": 2})
    results = {f"{n}/{sp}/{o}": _train_once(runtime, n, "hsdp", sp, o) for n, sp, o in HSDP_CASES}
    lamina.shutdown()
    return results


@pytest.fixture(scope="module")
def tp_hsdp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import json

    from topologies_for_tests import two_hosts_of_two

    path = tmp_path_factory.mktemp("tp_hsdp") / "two_hosts_of_two.json"
    path.write_text(json.dumps(two_hosts_of_two()))
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu"), "LAMINA_TOPOLOGY": str(path)}
    return run_ranks(_tp_hsdp_job, 4, env=env, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("name", "sp", "optimizer"), HSDP_CASES)
def test_tp_by_hsdp_across_two_hosts_trains_as_one_process(
    tp_hsdp_results: list[dict[str, Any]], name: str, sp: bool, optimizer: str
) -> None:
    for rank, results in enumerate(tp_hsdp_results):
        got = results[f"{name}/{sp}/{optimizer}"]
        assert got["loss"] <= 1e-6, (rank, got)
        assert got["params"] <= 1e-5, (rank, got)
        assert got["strategy"] == "tp+hsdp"
        assert {"dp", "tp"} <= set(got["axes"]), got["axes"]


def _checkpoint_save(name: str, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from _gpt_model import lm_loss

    runtime = lamina.init(mesh={"fsdp": 2, "tp": 2})
    torch.manual_seed(0)
    x = _ids(1)
    model = lamina.distribute(_build(name), ["tp", "zero3"], example_inputs=(x,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm_loss(_logits(model, x), x).backward()  # weights moved off their initial values
    opt.step()
    dcp.save(get_model_state_dict(model), checkpoint_id=directory)
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if runtime.rank == 0:
        torch.save(whole, os.path.join(directory, "expected.pt"))
    lamina.shutdown()


def _checkpoint_load(name: str, directory: str, mesh: dict[str, int]) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    lamina.init(mesh=mesh)
    torch.manual_seed(1)  # other weights than the saved ones
    model = lamina.distribute(_build(name), ["tp", "zero3"], example_inputs=(_ids(1),))
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state)
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = torch.load(os.path.join(directory, "expected.pt"))
    diff = max((whole[k] - expected[k]).abs().max().item() for k in expected)
    lamina.shutdown()
    return diff


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_checkpoint_saved_under_tp2_fsdp2_loads_under_other_layouts_exactly(
    name: str, tmp_path: Any
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    directory = str(tmp_path / "ckpt")
    run_ranks(_checkpoint_save, 4, args=(name, directory), env=env, timeout=300)
    loads = {
        "tp1xfsdp4": run_ranks(
            _checkpoint_load, 4, args=(name, directory, {"fsdp": 4, "tp": 1}), env=env
        ),
        "tp2xfsdp1": run_ranks(
            _checkpoint_load, 2, args=(name, directory, {"fsdp": 1, "tp": 2}), env=env
        ),
    }
    assert {k: max(v) for k, v in loads.items()} == {"tp1xfsdp4": 0.0, "tp2xfsdp1": 0.0}
    dcp_to_torch_save(directory, str(tmp_path / "whole.pt"))  # one process, no job
    whole = torch.load(tmp_path / "whole.pt")
    expected = torch.load(os.path.join(directory, "expected.pt"))
    assert all(torch.equal(whole[k], expected[k]) for k in expected)
    assert not all(torch.equal(expected[k], v) for k, v in _build(name).state_dict().items())


def _meta_init(strategies: Any, mesh: dict[str, int]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from _gpt_model import lm_loss

    runtime = lamina.init(mesh=mesh)
    x = _ids(1)
    whole = tiny_llama(0).state_dict()
    with torch.device("meta"):
        model = tiny_llama(0)
    model = lamina.distribute(model, strategies, example_inputs=(x,))
    try:
        model(x)
        before = "no error"
    except ConfigError as exc:
        before = str(exc)
    model.to_empty(device="cpu")
    local_numel = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    torch.manual_seed(7)  # initialized shard by shard: two runs with one seed agree
    seeded = [
        (p.to_local() if hasattr(p, "to_local") else p).detach().normal_().clone()
        for p in model.parameters()
    ]
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():  # buffers outside the state dict (rotary frequencies)
        for name, buf in tiny_llama(0).named_buffers():
            model.get_buffer(name).copy_(buf)
    reference = lamina.distribute(tiny_llama(0), strategies, example_inputs=(x,))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(3):
        for m, opt in zip((model, reference), opts, strict=True):
            lm_loss(_logits(m, _ids(20 + step)), _ids(30 + step)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    diff = max(
        (a.to_local() - b.to_local() if hasattr(a, "to_local") else a - b).abs().max().item()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )
    lamina.shutdown()
    return {
        "before": before,
        "local_numel": local_numel,
        "seeded": [t.sum().item() for t in seeded],
        "diff": diff,
        "world": runtime.world_size,
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("strategies", "mesh"),
    [("tp", {"tp": 2}), (["tp", "zero3"], {"fsdp": 2, "tp": 2})],
    ids=["tp", "tp+zero3"],
)
def test_a_model_built_on_meta_materializes_only_its_shards_and_trains_as_one_built_on_cpu(
    strategies: Any, mesh: dict[str, int]
) -> None:
    world = 1
    for size in mesh.values():
        world *= size
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    first = run_ranks(_meta_init, world, args=(strategies, mesh), env=env, timeout=300)
    second = run_ranks(_meta_init, world, args=(strategies, mesh), env=env, timeout=300)
    total = sum(p.numel() for p in tiny_llama(0).parameters())
    norms = sum(p.numel() for n, p in tiny_llama(0).named_parameters() if "norm" in n)
    for a, b in zip(first, second, strict=True):
        assert a["before"].count("\n") == 0 and "meta device" in a["before"]
        assert a["seeded"] == b["seeded"]  # the same seed, the same weights
        assert a["diff"] <= 1e-6, a
        # 1/N of the model, plus the replicated norms (tp alone) and alignment (zero3)
        assert a["local_numel"] <= total / world + norms + 64, (a["local_numel"], total)


def _resume_job(directory: str, mesh: dict[str, int], save: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from _gpt_model import lm_loss
    from lamina.checkpoint import CheckpointManager

    lamina.init(mesh=mesh)
    torch.manual_seed(0)
    model = lamina.distribute(tiny_llama(0), ["tp", "zero3"], example_inputs=(_ids(1),))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(directory)
    start = 0 if save else manager.load_latest(model, opt)
    losses = []
    for step in range(start or 0, 4):
        if save and step == 2:
            manager.save(step, model, opt)
            manager.wait()
        loss = lm_loss(_logits(model, _ids(40 + step)), _ids(50 + step))  # one batch for all
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    options = StateDictOptions(full_state_dict=True)
    whole = get_model_state_dict(model, options=options)  # the whole tensors, any layout
    manager.close()
    lamina.shutdown()
    return {"losses": losses[-2:], "whole": whole, "start": start}


@pytest.mark.timeout(600)
def test_a_checkpoint_manager_resume_on_another_tp_layout_continues_the_same_training(
    tmp_path: Any,
) -> None:
    from lamina.checkpoint.inspect import list_steps

    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    directory = str(tmp_path / "run")
    saved = run_ranks(
        _resume_job, 4, args=(directory, {"fsdp": 2, "tp": 2}, True), env=env, timeout=300
    )[0]
    (info,) = list_steps(tmp_path / "run")
    assert (info.strategy, info.layout) == ("tp+zero3", "fsdp=2 x tp=2")
    resumed = run_ranks(
        _resume_job, 4, args=(directory, {"fsdp": 4, "tp": 1}, False), env=env, timeout=300
    )[0]
    assert resumed["start"] == 2
    assert resumed["losses"] == pytest.approx(saved["losses"], rel=1e-6)
    diff = max((resumed["whole"][n] - p).abs().max().item() for n, p in saved["whole"].items())
    assert diff <= 1e-5  # Adam's moments resumed too: the same training on another layout


def _loss_parallel_job(name: str) -> dict[str, float]:
    import torch.nn.functional as F

    lamina.init(mesh={"tp": 2})
    torch.manual_seed(0)
    model = lamina.distribute(_build(name), "tp", example_inputs=(_ids(1),))
    x, y = _ids(2), _ids(3)
    y[0, :4] = -100  # ignored positions

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    whole = loss_of(_logits(model, x))
    whole.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    with lamina.loss_parallel(model):
        logits = _logits(model, x)
        split_width = logits.shape[-1]
        split = loss_of(logits)
    split.backward()
    grad_diff = max(
        (g - p.grad).abs().max().item()  # type: ignore[operator]
        for g, p in zip(grads, model.parameters(), strict=True)
    )
    lamina.shutdown()
    return {
        "loss_diff": abs(whole.item() - split.item()) / whole.item(),
        "grad_diff": grad_diff,
        "split_width": split_width,
    }


@pytest.mark.timeout(300)
def test_loss_parallel_cross_entropy_on_split_logits_equals_the_whole_one() -> None:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    for name in ("gpt", "llama"):
        for got in run_ranks(_loss_parallel_job, 2, args=(name,), env=env, timeout=200):
            assert got["split_width"] == VOCAB // 2  # never gathered
            assert got["loss_diff"] <= 1e-6, (name, got)
            assert got["grad_diff"] <= 1e-6, (name, got)
