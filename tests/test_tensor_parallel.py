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
from models_for_tests import full_params, tiny_gpt, tiny_llama

VOCAB, BATCH, SEQ = 64, 2, 16


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _torchtitan_llama_plan(layers: int) -> dict[str, ParallelStyle]:
    """The hand-written plan torchtitan gives a Llama, in Hugging Face's module names."""
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
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
        return shard_rows(full, tp, columns[module].chunks)
    if module in rows and attr == "weight":
        return shard_columns(full, tp)
    if module in {e.module for e in plan.embeddings} | {h.module for h in plan.heads}:
        return shard_rows(full, tp)
    return full


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _build(name: str) -> nn.Module:
    return tiny_gpt() if name == "gpt" else tiny_llama(0)


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
    ours = lamina.distribute(ours, ["tp", follower], example_inputs=(xs[0],), sequence_parallel=sp)

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
    return {"loss": max(loss_errors), "params": diff, "strategy": plan.strategy, "axes": axes}


#: Sequence parallelism on and off, SGD and AdamW, on each model.
CASES = [
    ("gpt", True, "adamw"),
    ("gpt", False, "sgd"),
    ("llama", True, "sgd"),
    ("llama", False, "adamw"),
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
        assert got["axes"] == ["fsdp", "tp", "world"]
