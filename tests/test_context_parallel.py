"""Context parallelism (``"cp"``): the sequence split across ranks trains as one process.

On 4 gloo ranks, against one process on the same global batch, from the same weights:
``["cp", "zero3"]`` with cp=2 x dp_shard=2 (zero3 spanning both axes) and cp=4, on the
GPT example, the fused Llama (grouped-query attention, complex rotary tables cut as
``table[:seq]``) and a transformers Llama (its attention interface, rotary from position
ids), each attention algorithm, causal and packed documents (``document_ids=`` or position
ids restarting per document), SGD and AdamW: per-step losses within 1e-6 relative,
parameters within 1e-5 after 5 steps; cp alone averages its own gradients. The run log
records exactly the plan's cp nodes each step. Refusals are one line before any
collective.
"""

from __future__ import annotations

import copy
import itertools
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

import lamina
from lamina.errors import ConfigError
from lamina.strategies.cp.layout import SequenceLayout
from lamina.strategies.cp.masks import Masking, documents_from_positions
from lamina.testing import run_ranks
from modern_models import fused_llama

pytestmark = [pytest.mark.multiprocess]

VOCAB, BATCH, SEQ, STEPS = 64, 2, 32, 5


def _gpt_model() -> nn.Module:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from _gpt_model import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=2, n_heads=4))


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return _gpt_model()


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


MODELS = {
    "gpt": _gpt,
    "llama": lambda: fused_llama(seed=0, max_seq=SEQ),
    "hf": _hf_llama,
}


class _DocumentMask(TorchFunctionMode):
    """One process's attention with packed documents: causal within each document."""

    def __init__(self, documents: torch.Tensor) -> None:
        super().__init__()
        self.documents = documents

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and kwargs.pop("is_causal", False):
            docs = self.documents
            n = docs.shape[-1]
            allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(
                n, n, dtype=torch.bool
            ).tril()
            kwargs["attn_mask"] = allowed.unsqueeze(1)
        return func(*args, **kwargs)


def _packed(seed: int) -> torch.Tensor:
    """Position ids of documents packed into each row (lengths drawn per row)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(BATCH):
        cuts = sorted(torch.randperm(SEQ - 1, generator=g)[:3].add(1).tolist())
        bounds = [0, *cuts, SEQ]
        rows.append(torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(bounds)]))
    return torch.stack(rows)


def _logits(
    model: nn.Module, name: str, x: torch.Tensor, positions: torch.Tensor | None
) -> torch.Tensor:
    if name == "hf":
        out = (
            model(x, position_ids=positions, use_cache=False)
            if positions is not None
            else model(x, use_cache=False)
        )
        return out.logits
    return model(x)


def _lm(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _train(
    strategies: list[str], name: str, attention: str, docs: bool, optimizer: str
) -> dict[str, Any]:
    reference = MODELS[name]()
    ours = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, VOCAB, (STEPS * 2, BATCH, SEQ), generator=g)
    ys = torch.randint(0, VOCAB, (STEPS * 2, BATCH, SEQ), generator=g)
    pipelined = "pp" in strategies
    extra = {"microbatches": 2} if pipelined else {}
    model = lamina.distribute(
        ours, strategies, example_inputs=(xs[0],), attention=attention, **extra
    )
    replica, replicas = model.data_replica
    # AdamW's eps at 1e-6: an entry of the gradient far below eps has its rounding (the
    # attention blocks are summed in another order: ~1e-7 relative) divided by eps; at
    # torch's 1e-8 a 1e-10 gradient turns rounding into 1e-5 of parameter (measured:
    # 2e-5 after 5 steps at 1e-8, 7e-7 at 1e-6; SGD 6e-8)
    make = (
        (lambda p: torch.optim.SGD(p, lr=0.1))
        if optimizer == "sgd"
        else (lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-6))
    )
    opt_ref, opt_ours = make(reference.parameters()), make(model.parameters())
    loss_errors = []
    state = model.lamina_cp
    planned = {
        n.id
        for n in state.execution_plan.nodes
        if n.kind in ("collective", "send", "recv") and n.phase != "setup"
    }
    recorded: list[set[str]] = []
    for step in range(STEPS):
        parts = []
        for k in range(step * replicas, (step + 1) * replicas):
            positions = _packed(100 + k) if docs else None
            if docs and name != "hf":
                with _DocumentMask(documents_from_positions(positions)):
                    logits = _logits(reference, name, xs[k], None)
            else:
                logits = _logits(reference, name, xs[k], positions)
            parts.append(_lm(logits, ys[k]))
        (sum(parts) / replicas).backward()
        k = step * replicas + replica
        positions = _packed(100 + k) if docs else None
        given: dict[str, Any] = {}
        if docs and name != "hf":
            given["document_ids"] = documents_from_positions(positions)
        elif positions is not None:
            given["position_ids"] = positions
        if pipelined:
            loss = model.step(xs[k], ys[k], _lm, input_kwargs=given)
        else:
            out = model(xs[k], **given)
            loss = _lm(out.logits if name == "hf" else out, ys[k])
            loss.backward()
        for opt in (opt_ref, opt_ours):
            opt.step()
            opt.zero_grad(set_to_none=True)
        want = parts[replica].item()
        loss_errors.append(abs(loss.item() - want) / abs(want))
        last = state.run_log.current
        recorded.append({*last.issued, *last.transfers})
    named = dict(reference.named_parameters(remove_duplicate=False))  # a tie, by both names
    diff = max((named[n].detach() - p).abs().max().item() for n, p in _whole(model).items())
    held = []
    for site in state.sites:
        try:
            model.get_submodule(site.module)
            held.append(site.index)
        except AttributeError:
            pass
    return {
        "loss": max(loss_errors),
        "params": diff,
        "planned": sorted(planned),
        "recorded": [sorted(r) for r in recorded],
        "algorithms": list(state.algorithms),
        "held_sites": held,
        "pipelined": pipelined,
    }


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name (collective under zero3 and tp: every rank)."""
    names = {n for n, _ in model.named_parameters()}
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v
        for k, v in model.state_dict().items()
        if k in names
    }


#: (mesh, strategies, model, attention, packed documents, optimizer)
CASES = [
    ("cp2xdp2", ["cp", "zero3"], "gpt", "pass_kv", False, "adamw"),
    ("cp2xdp2", ["cp", "zero3"], "gpt", "all_gather", False, "sgd"),
    ("cp2xdp2", ["cp", "zero3"], "gpt", "all_to_all", True, "adamw"),
    ("cp2xdp2", ["cp", "zero3"], "llama", "pass_kv", True, "sgd"),
    ("cp2xdp2", ["cp", "zero3"], "llama", "all_to_all", False, "adamw"),
    ("cp2xdp2", ["cp", "zero3"], "hf", "pass_kv", False, "adamw"),
    ("cp2xdp2", ["cp", "zero3"], "hf", "all_gather", True, "sgd"),
    ("cp4", ["cp", "zero3"], "gpt", "all_to_all", False, "sgd"),
    ("cp4", ["cp", "zero3"], "llama", "pass_kv", False, "adamw"),
    ("cp4", ["cp", "zero3"], "hf", "all_gather", True, "adamw"),
    ("cp4", ["cp"], "gpt", "pass_kv", True, "sgd"),
    ("cp4", ["cp"], "llama", "all_gather", False, "adamw"),
]
MESHES = {"cp2xdp2": {"dp_shard": 2, "cp": 2}, "cp4": {"cp": 4}}


class _MaskedAttention(nn.Module):
    """Attention with a mask of its own: a kind context parallelism does not split."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).unsqueeze(1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask).squeeze(1)


def _refusals() -> dict[str, str]:
    """Each refusal's message (every rank raises it before a collective, so the job goes
    on to the next)."""
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    tries = {
        "heads": lambda: lamina.distribute(
            fused_llama(seed=0, max_seq=SEQ, heads=2, kv_heads=2),
            ["cp", "zero3"],
            example_inputs=(x,),
            attention="all_to_all",
        ),
        "sequence": lambda: lamina.distribute(
            fused_llama(seed=0, max_seq=SEQ), ["cp", "zero3"], example_inputs=(x[:, :28],)
        ),
        "mask": lambda: lamina.distribute(_MaskedAttention(), "cp", example_inputs=(x,)),
    }
    said = {}
    for name, attempt in tries.items():
        try:
            attempt()
        except ConfigError as error:
            said[name] = str(error)
    return said


def _checkpoint(path: str, save: bool) -> dict[str, Any]:
    """The GPT under ``["cp", "zero3"]``: trained 2 steps and saved through DCP, or a fresh
    one loaded from that checkpoint (another cp degree: cp is not in the layout)."""
    import torch.distributed.checkpoint as dcp

    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(3 if save else 4)  # other weights for the model that loads
    model = lamina.distribute(_gpt_model(), ["cp", "zero3"], example_inputs=(x,))
    if save:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            _lm(model(x), x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    else:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
    return {n: t.clone() for n, t in _whole(model).items()}


def _job(path: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mesh in MESHES:
        lamina.init(mesh=MESHES[mesh])
        for case in CASES:
            if case[0] == mesh:
                results[_key(case)] = _train(*case[1:])
        # saved under cp=2 x dp_shard=2, loaded under cp=4
        results[f"checkpoint/{mesh}"] = _checkpoint(path, save=mesh == "cp2xdp2")
        if mesh == "cp4":
            results["refusals"] = _refusals()
        lamina.shutdown()
    return results


#: 8 ranks: cp composed with tp (sharded over dp_shard x cp) and with pp.
CASES_8 = [
    ("tp", ["tp", "cp", "zero3"], "gpt", "pass_kv", False, "adamw"),
    ("tp", ["tp", "cp", "zero3"], "llama", "all_to_all", True, "sgd"),
    ("pp", ["pp", "cp", "zero3"], "gpt", "all_gather", True, "sgd"),
    ("pp", ["pp", "cp", "zero3"], "hf", "pass_kv", False, "adamw"),
]
MESHES_8 = {"tp": {"dp_shard": 2, "cp": 2, "tp": 2}, "pp": {"pp": 2, "dp_shard": 2, "cp": 2}}


def _job_8() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mesh in MESHES_8:
        lamina.init(mesh=MESHES_8[mesh])
        for case in CASES_8:
            if case[0] == mesh:
                results[_key(case)] = _train(*case[1:])
        lamina.shutdown()
    return results


def _key(case: tuple[Any, ...]) -> str:
    return "/".join(str(c) for c in case)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    path = str(tmp_path_factory.mktemp("cp_checkpoint"))
    return run_ranks(_job, 4, args=(path,), env=env, timeout=600)


@pytest.fixture(scope="module")
def results_8() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_job_8, 8, env=env, timeout=900)


def _check(results: list[dict[str, Any]], case: tuple[Any, ...]) -> None:
    for rank, by_case in enumerate(results):
        got = by_case[_key(case)]
        assert got["loss"] <= 1e-6, (rank, got)
        assert got["params"] <= 1e-5, (rank, got)
        assert got["algorithms"] == [case[3]] * len(got["algorithms"]), got
        if not got["pipelined"]:
            # every step issued exactly the plan's cp collectives and ring transfers
            for recorded in got["recorded"]:
                assert recorded == got["planned"], (rank, recorded, got["planned"])
            continue
        # a pipeline stage runs the attention of its own blocks only, found by module
        recorded = set(got["recorded"][-1])
        assert recorded <= set(got["planned"]), (rank, recorded)
        sites = {int(n.split(".")[1]) for n in recorded if n.startswith("attention.")}
        assert sites == set(got["held_sites"]) and sites, (rank, sites, got["held_sites"])


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_context_parallel_trains_as_one_process(
    results: list[dict[str, Any]], case: tuple[Any, ...]
) -> None:
    _check(results, case)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("case", CASES_8, ids=_key)
def test_cp_composed_with_tp_and_pp_trains_as_one_process(
    results_8: list[dict[str, Any]], case: tuple[Any, ...]
) -> None:
    _check(results_8, case)


def test_layout_balances_causal_work_with_head_and_tail_chunks() -> None:
    layout = SequenceLayout(16, 4, 1)
    assert layout.positions().tolist() == [2, 3, 12, 13]
    # each rank's queries see as many earlier keys: sum of positions is equal on every rank
    sums = {int(SequenceLayout(16, 4, r).positions().sum()) for r in range(4)}
    assert len(sums) == 1
    unbalanced = SequenceLayout(16, 4, 1, balanced=False)
    assert unbalanced.positions().tolist() == [4, 5, 6, 7]
    gathered = layout.gathered_order()
    assert gathered[layout.to_global()].tolist() == list(range(16))


def test_sequence_cp_does_not_divide_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"30 tokens does not split into 8 equal chunks.*pad"):
        SequenceLayout(30, 4, 0)


def test_documents_from_restarting_positions() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert documents_from_positions(positions).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert documents_from_positions(torch.arange(8)[None]) is None
    masking = Masking(True, documents_from_positions(positions))
    # chunks of 2: query chunk 2 (positions 4, 5) against key chunk 0 (0, 1): other docs
    assert masking.block(2, 0, 2, torch.float32).kind == "skip"
    assert masking.block(1, 0, 2, torch.float32).kind == "masked"
    assert masking.block(0, 1, 2, torch.float32).kind == "skip"


def test_what_cp_cannot_split_is_one_line_before_any_collective(
    results: list[dict[str, Any]],
) -> None:
    for by_case in results:
        said = by_case["refusals"]
        assert set(said) == {"heads", "sequence", "mask"}, said
        assert all("\n" not in line for line in said.values()), said
        assert "2 query and 2 key/value heads, which cp=4 does not divide" in said["heads"]
        assert "attention='pass_kv'" in said["heads"]
        assert "28 tokens does not split into 8 equal chunks" in said["sequence"]
        assert "pad the sequence to a multiple of 8" in said["sequence"]
        assert "passes attn_mask" in said["mask"] and "document_ids=" in said["mask"]


def test_a_checkpoint_loads_across_cp_degrees(results: list[dict[str, Any]]) -> None:
    for by_case in results:
        saved, loaded = by_case["checkpoint/cp2xdp2"], by_case["checkpoint/cp4"]
        assert saved.keys() == loaded.keys()
        for name, tensor in saved.items():
            assert torch.equal(tensor, loaded[name]), name
