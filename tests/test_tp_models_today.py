"""Tensor parallelism on models written as people train them today
(:mod:`modern_models`): a Llama with one fused ``wqkv``, complex rotary embeddings and
its blocks in an ``nn.ModuleDict``; transformers' Qwen3 (per-head q/k norms) and
Qwen3-MoE. Their attention is split by heads; ``["tp", "zero3"]`` on 4 ranks trains as
one process does, with the plan derived and with a plan given as torch writes it."""

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
from models_for_tests import full_params
from modern_models import VOCAB, fused_llama, qwen3, qwen3_moe

BATCH, SEQ = 2, 16
#: Below every step's gradient norm of these models, so clipping scales every step.
MAX_NORM = 0.05


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def fused_llama_plan(layers: int, sp: bool = True) -> dict[str, ParallelStyle]:
    """The fused Llama's plan written by hand as torchtitan writes a Llama's."""
    between = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(layers):
        block = f"layers.{i}"
        plan |= {
            f"{block}.attention.wqkv": ColwiseParallel(),
            f"{block}.attention.wo": RowwiseParallel(output_layouts=between),
            f"{block}.feed_forward.w1": ColwiseParallel(),
            f"{block}.feed_forward.w3": ColwiseParallel(),
            f"{block}.feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if sp:
            plan |= {
                f"{block}.attention_norm": SequenceParallel(),
                f"{block}.attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                f"{block}.ffn_norm": SequenceParallel(),
                f"{block}.feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
    return plan


def qwen3_plan(layers: int, sp: bool) -> dict[str, ParallelStyle]:
    """transformers' Qwen3 plan written by hand, q/k norms as torchtitan's Qwen3 gives
    them (``SequenceParallel`` on the heads dim: whole weights, gradients summed)."""
    between = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        ),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sp:  # split entering the first block: the model reads the embedding's output
        plan["model.norm"] = SequenceParallel()
        plan["model.layers.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    for i in range(layers):
        block = f"model.layers.{i}"
        plan |= {
            f"{block}.self_attn.q_proj": ColwiseParallel(),
            f"{block}.self_attn.k_proj": ColwiseParallel(),
            f"{block}.self_attn.v_proj": ColwiseParallel(),
            f"{block}.self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            f"{block}.self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            f"{block}.self_attn.o_proj": RowwiseParallel(output_layouts=between),
            f"{block}.mlp.gate_proj": ColwiseParallel(),
            f"{block}.mlp.up_proj": ColwiseParallel(),
            f"{block}.mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if sp:
            plan |= {
                f"{block}.input_layernorm": SequenceParallel(),
                f"{block}.self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                f"{block}.post_attention_layernorm": SequenceParallel(),
                f"{block}.mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
    return plan


#: The attention projections of each model, and the heads each rank holds of them.
ATTENTION = {
    "fused": ("layers.{i}.attention.wqkv",),
    "fused-qk": ("layers.{i}.attention.wqkv",),
    "qwen3": tuple(f"model.layers.{{i}}.self_attn.{p}_proj" for p in "qkv"),
    "moe": tuple(f"model.layers.{{i}}.self_attn.{p}_proj" for p in "qkv"),
}


def _build(name: str) -> nn.Module:
    if name.startswith("fused"):
        return fused_llama(0, qk_norm=name.startswith("fused-qk"))
    return qwen3_moe(0) if name == "moe" else qwen3(0)


def _given(name: str, sp: bool) -> dict[str, Any]:
    if name == "qwen3-given":
        return {"plan": qwen3_plan(2, sp)}
    if name == "fused-given":
        return {"plan": fused_llama_plan(2, sp)}
    return {"sequence_parallel": sp}


def test_the_fused_llama_plan_derived_is_the_hand_written_one() -> None:
    for sp in (True, False):
        plan = derive_plan(fused_llama(0), (_ids(0),), None, 2, sequence_parallel=sp)
        derived = {name: style_key(s) for name, s in torch_styles(plan).items()}
        written = {name: style_key(s) for name, s in fused_llama_plan(2, sp).items()}
        assert derived == written, sp
        column = plan.columns()["layers.0.attention.wqkv"]
        assert column.sections == (64, 32, 32) and column.heads == 4
        assert [w.op for w in plan.written_sizes] == ["split", "split"]
        assert not plan.replicated


def test_head_local_ops_split_with_the_heads_and_their_weights_are_summed() -> None:
    for build, norms in ((lambda: fused_llama(0, qk_norm=True), "attention"), (qwen3, "self_attn")):
        plan = derive_plan(build(), (_ids(0),), None, 2, sequence_parallel=False)
        assert not plan.replicated, plan.replicated
        shared = dict(plan.shared_modules)
        assert {n.rsplit(".", 1)[1] for n in shared} == {"q_norm", "k_norm"}
        assert all(f".{norms}." in n and dim == 2 for n, dim in shared.items())


def test_the_qwen3_plan_written_as_torchtitan_writes_it_is_the_derived_one() -> None:
    for sp in (True, False):
        model = qwen3(0)
        derived = derive_plan(model, (_ids(0),), None, 2, sequence_parallel=sp)
        given = derive_plan(
            model, (_ids(0),), None, 2, sequence_parallel=sp, given=qwen3_plan(2, sp)
        )
        assert given.differences == (), given.differences
        assert given.lines()[1:] == derived.lines()[1:]


class _HeadMixingRotary(nn.Module):
    """Rotary embedding, then a transform across the heads: not head-local."""

    def forward(
        self, xq: torch.Tensor, xk: torch.Tensor, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.fft.fft(xq, dim=2).real, xk


def _head_mixing_llama() -> nn.Module:
    model = fused_llama(0)
    model.layers["0"].attention.rope = _HeadMixingRotary()  # type: ignore[index]
    return model


def test_an_op_mixing_the_heads_keeps_attention_replicated_and_is_named() -> None:
    plan = derive_plan(_head_mixing_llama(), (_ids(0),), None, 2, sequence_parallel=False)
    why = dict(plan.replicated)["layers.0.attention.wqkv"]
    assert why == "fft_fft in layers.0.attention.rope does not keep the split dim apart", why
    assert "layers.1.attention.wqkv" in plan.columns()


def test_with_sequence_parallelism_a_replicated_region_names_the_op_that_kept_it() -> None:
    with pytest.raises(ConfigError) as err:
        derive_plan(_head_mixing_llama(), (_ids(0),), None, 2, sequence_parallel=True)
    message = str(err.value)
    assert "\n" not in message
    assert "layers.0.attention" in message and "layers.1" not in message, message
    assert "fft_fft in layers.0.attention.rope" in message, message


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


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train_once(runtime: Any, name: str, sp: bool, optimizer: str) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _build(name)
    ours = _build(name)
    if runtime.rank:  # rank-seeded weights: the setup broadcast makes them rank 0's
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(torch.randn_like(p))
    replica = runtime.mesh.coordinates().get("fsdp", 0)
    replicas = runtime.world_size // runtime.mesh.size("tp")
    xs = [_ids(10 + k) for k in range(5 * replicas)]
    ys = [_ids(100 + k) for k in range(5 * replicas)]
    ours = lamina.distribute(ours, ["tp", "zero3"], example_inputs=(xs[0],), **_given(name, sp))

    def make(params: Any) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1)
        return torch.optim.AdamW(params, lr=1e-3)

    opt_ref, opt_ours = make(reference.parameters()), make(ours.parameters())
    loss_errors, norm_errors = [], []
    for step in range(5):
        batch = range(step * replicas, (step + 1) * replicas)
        parts = [_lm_loss(_logits(reference, xs[k]), ys[k]) for k in batch]
        (sum(parts) / replicas).backward()
        k = step * replicas + replica
        loss = _lm_loss(_logits(ours, xs[k]), ys[k])
        loss.backward()
        # clipped below every step's norm: the whole model's norm as one process has it
        # (q/k norm weights whole on each tp rank, counted once)
        want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        norm = ours.clip_grad_norm_(MAX_NORM)  # type: ignore[operator]
        assert want_norm.item() > MAX_NORM, "the bound must clip"
        norm_errors.append(abs(norm.item() - want_norm.item()) / want_norm.item())
        for opt in (opt_ref, opt_ours):
            opt.step()
            opt.zero_grad(set_to_none=True)
        want = parts[replica].item()
        loss_errors.append(abs(loss.item() - want) / abs(want))
    state = ours.lamina_tp  # type: ignore[union-attr]
    named = dict(reference.named_parameters())
    diff = max(
        (_expected_local(state.plan, n, named[n].detach(), state.group) - p).abs().max().item()
        for n, p in full_params(ours).items()
    )
    # attention split by heads: each projection holds half its rows (whole heads: the
    # parameters above match the reference's heads part by part)
    attention = [p.format(i=i) for i in range(2) for p in ATTENTION[name.replace("-given", "")]]
    gathered = full_params(ours)
    held = {
        linear: (
            int(gathered[f"{linear}.weight"].shape[0]),
            int(named[f"{linear}.weight"].shape[0]),
        )
        for linear in attention
    }
    return {
        "loss": max(loss_errors),
        "norm": max(norm_errors),
        "params": diff,
        "columns": sorted(state.plan.columns()),
        "attention": attention,
        "held": held,
        "shared": [n for n, _ in state.plan.shared_modules],
        "source": state.plan.source,
        "strategy": ours.execution_plan.strategy,  # type: ignore[union-attr]
    }


#: (model, sequence parallelism, optimizer): each model derived with sequence
#: parallelism on and off, SGD and AdamW, and given as torch writes its plan.
CASES = [
    ("fused", True, "adamw"),
    ("fused", False, "sgd"),
    ("fused-qk", True, "sgd"),
    ("fused-given", True, "adamw"),
    ("qwen3", True, "sgd"),
    ("qwen3", False, "adamw"),
    ("qwen3-given", True, "adamw"),
    ("qwen3-given", False, "sgd"),
    ("moe", True, "adamw"),
    ("moe", False, "sgd"),
]


def _tp_zero3_job() -> dict[str, Any]:
    runtime = lamina.init(mesh=((2, 2), ("fsdp", "tp")))
    results = {f"{n}/{sp}/{o}": _train_once(runtime, n, sp, o) for n, sp, o in CASES}
    lamina.shutdown()
    return results


@pytest.fixture(scope="module")
def tp_zero3_results() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_tp_zero3_job, 4, env=env, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("name", "sp", "optimizer"), CASES)
def test_tp_by_zero3_on_todays_models_trains_as_one_process_with_attention_split_by_heads(
    tp_zero3_results: list[dict[str, Any]], name: str, sp: bool, optimizer: str
) -> None:
    for rank, results in enumerate(tp_zero3_results):
        got = results[f"{name}/{sp}/{optimizer}"]
        assert got["loss"] <= 1e-6, (rank, got)
        assert got["params"] <= 1e-5, (rank, got)
        assert got["norm"] <= 1e-6, (rank, got)
        assert got["strategy"] == "tp+zero3"
        assert set(got["attention"]) <= set(got["columns"]), (rank, got)
        for linear, (local, whole) in got["held"].items():
            assert local * 2 == whole, (rank, linear, local, whole)
        if name in ("fused-qk", "qwen3", "qwen3-given", "moe"):
            assert len(got["shared"]) == 4, got["shared"]  # q/k norms of 2 layers
        given = name.endswith("-given")
        assert got["source"] == (
            "given as torch ParallelStyle objects" if given else "derived from the captured graph"
        )
