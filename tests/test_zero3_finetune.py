"""Real fine-tuning under ``zero3`` and ``hsdp`` equals torch DDP (issue 26).

A tiny transformers Llama (hidden 32, 2 layers) built from a config, one unit per decoder
layer, trains 3 SGD steps on 2 gloo ranks (``hsdp``: 4 ranks on a declared 2 x 2
topology) beside DDP with the same feature; every rank builds its model from its own
seed, so only the wrap-time broadcasts (or, for a model built on meta, the state dict
loaded from rank 0) make them agree. Every step's gradients, gathered from the shards,
must equal DDP's, and the parameters after the steps. The features:

- frozen-heavy models: LoRA through peft (every base weight frozen: a frozen root unit,
  adapters in the layer units), prompt tuning through peft (trainable prompt at the
  root, every layer unit frozen: backward gathers frozen units), a frozen root and a
  frozen layer unit without peft, a frozen backbone with a trained head;
- activation checkpointing: transformers' ``gradient_checkpointing_enable`` before and
  after ``distribute`` (also with the layers merged into one unit gathered for the whole
  forward), torch's ``checkpoint_wrapper`` on each layer; each counts the recomputed
  forwards, so a checkpointing that silently stopped recomputing fails;
- a model built on the meta device: ``to_empty`` holds only this rank's shards (1/N of
  the model plus alignment), ``init_weights`` / ``reset_parameters`` on the shards give
  bit for bit what they give the unsharded model from the same seed, a full state dict
  loaded with ``set_model_state_dict`` from rank 0 then trains equal to DDP; a forward
  before ``to_empty`` is one line;
- the model's own methods: ``generate`` (sharded, and inside ``full_parameters()``),
  ``save_pretrained`` (one line outside ``full_parameters()``, loads back with
  transformers and peft inside it), ``state_dict()``, ``load_state_dict()`` of a full
  state dict, ``to()``, ``train()/eval()`` before the first forward.

One module-scoped 2-rank job and one 4-rank job run every case; each test asserts on its
part.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.errors import ConfigError
from lamina.testing import run_ranks
from models_for_tests import full_params, shard_grad_diff
from topologies_for_tests import two_hosts_of_two

# transformers is imported where used (2 s of every xdist worker's collection otherwise)
pytestmark = [
    pytest.mark.portable,
    pytest.mark.multiprocess,
    pytest.mark.cross_release,
    pytest.mark.skipif(
        find_spec("transformers") is None,
        reason="the fine-tuning tests build a transformers Llama (examples extra)",
    ),
]

VOCAB, STEPS, LR = 64, 3, 0.1
#: fp32 sharded training and DDP differ only in the rounding order of the mean gradient
#: (a few float32 ulps per step); a lost or doubled contribution is off by >= 0.5
#: (gradients, relative to the largest) or >= 1e-3 (parameters after the steps).
GRAD_TOLERANCE = PARAM_TOLERANCE = 1e-6


def _has_peft() -> bool:
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


# -- models and features -------------------------------------------------------------
def llama(seed: int | None = 0, layers: int = 2) -> nn.Module:
    """The tiny Llama from a config; ``seed=None`` draws from the generator as it is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model: nn.Module = LlamaForCausalLM(config)
    return model


def _lora(seed: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    # both adapter matrices random (not B = 0), so that A has a gradient from step one
    config = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    model: nn.Module = get_peft_model(llama(seed), config)
    return model


def _prompt(seed: int) -> nn.Module:
    from peft import PromptTuningConfig, TaskType, get_peft_model

    config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3)
    # 4 frozen layers: backward must free the ones it has passed before the end
    model: nn.Module = get_peft_model(llama(seed, layers=4), config)
    return model


def _frozen_root_and_layer(seed: int) -> nn.Module:
    model = llama(seed).requires_grad_(False)
    model.model.layers[1].requires_grad_(True)  # type: ignore[union-attr,index]
    return model


def _trained_head(seed: int) -> nn.Module:
    model = llama(seed).requires_grad_(False)
    model.lm_head.requires_grad_(True)  # type: ignore[union-attr]
    return model


def _hf_checkpointing(model: nn.Module) -> None:
    """transformers' own activation checkpointing, as the issue's users call it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed in 5.x, removed in v6
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )


def _hf_checkpointed(seed: int) -> nn.Module:
    model = llama(seed)
    _hf_checkpointing(model)
    return model


def _wrapped_layers(seed: int) -> nn.Module:
    """torch's ``checkpoint_wrapper`` around each decoder layer (non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = llama(seed)
    layers = model.model.layers  # type: ignore[union-attr]
    for k in range(len(layers)):  # type: ignore[arg-type]
        layers[k] = checkpoint_wrapper(layers[k])  # type: ignore[index]
    return model


def tokens(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, 8), generator=gen)


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=x, labels=x).loss
    return loss


def _mlps(model: nn.Module) -> list[nn.Module]:
    """Layer 0's MLP (inside a ``checkpoint_wrapper`` too)."""
    ends = ("layers.0.mlp", "layers.0._checkpoint_wrapped_module.mlp")
    return [m for n, m in model.named_modules() if n.endswith(ends)]


def _watch_gathered_in_backward(model: nn.Module) -> list[int]:
    """The number of units holding gathered parameters each time backward reaches a
    decoder layer's output (appended to the returned list)."""
    engine = model.lamina_engine  # type: ignore[union-attr]
    counts: list[int] = []

    def watch(_module: nn.Module, _args: object, out: object) -> None:
        first = out[0] if isinstance(out, tuple) else out
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(
                lambda _g: counts.append(sum(u.full is not None for u in engine.units))
            )

    layers = next(m for n, m in model.named_modules() if n.endswith("layers"))
    for layer in layers:  # type: ignore[union-attr]
        layer.register_forward_hook(watch)
    return counts


# -- one comparison with DDP -------------------------------------------------------------
def _compare(
    build: Callable[[int], nn.Module],
    strategy: str,
    after: Callable[[nn.Module], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``strategy`` and DDP from rank-seeded ``build``; ``after``
    is applied to both models after wrapping (a feature switched on late)."""
    rank = dist.get_rank()
    initial = build(rank)
    started_apart = any(
        not torch.equal(a, b)
        for a, b in zip(initial.parameters(), build(0).parameters(), strict=True)
    )
    ours = lamina.distribute(copy.deepcopy(initial), strategy, **{"min_unit_numel": 0, **options})
    reference = copy.deepcopy(initial)
    if after is not None:
        after(ours)
        after(reference)
    ddp = DDP(reference)
    calls = [0]
    for mlp in _mlps(ours):  # forwards of layer 0's MLP: 2 per step when recomputed
        mlp.register_forward_pre_hook(lambda _m, _a: calls.__setitem__(0, calls[0] + 1))
    gathered_in_backward = _watch_gathered_in_backward(ours)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=LR)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=LR)
    grad_diffs = []
    for step in range(STEPS):
        x = tokens(step, rank)
        for model in (ours, ddp):
            lm_loss(model, x).backward()
        grad_diffs.append(shard_grad_diff(ours, ddp.module))
        for opt in (opt_ours, opt_ddp):
            opt.step()
            opt.zero_grad(set_to_none=True)
    gathered = full_params(ours)
    want = dict(ddp.module.named_parameters())
    plan = ours.execution_plan  # type: ignore[union-attr]
    engine = ours.lamina_engine  # type: ignore[union-attr]
    return {
        "started_apart": started_apart,
        "grad_diffs": grad_diffs,
        "diff": max((gathered[n] - p.detach()).abs().max().item() for n, p in want.items()),
        "names": sorted(gathered) == sorted(want),
        "trained": sorted(n for n, p in want.items() if p.requires_grad),
        "scatters": sorted(n.unit for n in plan.nodes if n.scatters_gradient),
        "frozen_units": str(dict(plan.meta).get("frozen_units", "")),
        "units": [u.layout.name for u in engine.units],
        "issued": sorted(ours.run_log.current.issued),  # type: ignore[union-attr]
        "held": [u.layout.name for u in engine.units if u.full is not None],
        "most_gathered_in_backward": max(gathered_in_backward, default=0),
        "mlp_forwards_per_step": calls[0] / STEPS,
        # the trained parameters moved (equal to DDP is not both standing still)
        "moved": max(
            (p.detach() - dict(initial.named_parameters())[n]).abs().max().item()
            for n, p in want.items()
            if p.requires_grad
        ),
    }


# -- meta device ---------------------------------------------------------------------------
def _meta_sharded(strategy: str) -> nn.Module:
    with torch.device("meta"):
        model = llama(None)
    return lamina.distribute(model, strategy, min_unit_numel=0)


def _unsharded_on_meta_then(init: Callable[[nn.Module], None]) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        plain = llama(None)
    plain.to_empty(device="cpu")
    init(plain)
    return {n: p.detach().clone() for n, p in plain.named_parameters()}


def _init_weights(model: nn.Module) -> None:
    torch.manual_seed(11)
    model.init_weights()  # type: ignore[operator]


def _reset_parameters(model: nn.Module) -> None:
    """Every submodule's own ``reset_parameters`` (nn.Linear, nn.Embedding), in order."""
    torch.manual_seed(12)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _meta_flow(strategy: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    ours = _meta_sharded(strategy)
    engine = ours.lamina_engine  # type: ignore[union-attr]
    try:
        ours(input_ids=tokens(0, rank))
        meta_forward = "no error"
    except ConfigError as exc:
        meta_forward = str(exc)
    setup = [n.id for n in ours.execution_plan.nodes if n.id.startswith("setup.")]  # type: ignore[union-attr]
    ours.to_empty(device="cpu")
    shards = {u.shard.untyped_storage().data_ptr() for u in engine.units}
    locals_in_shards = all(
        isinstance(p, DTensor) and p.to_local().untyped_storage().data_ptr() in shards
        for p in ours.parameters()
    )
    shard_bytes = sum(u.shard.untyped_storage().nbytes() for u in engine.units)
    world = engine.units[0].layout.world_size
    params = list(ours.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    # per unit: alignment (< alignment_bytes) and one flag element per parameter; per
    # parameter: rows rounded up to a multiple of the world size (< one row per rank)
    row_bytes = sum((p[0].numel() if p.dim() else 1) * p.element_size() for p in params)
    alignment = len(engine.units) * 512 + len(params) * 4 + row_bytes
    # initializers on the shards, against the unsharded model from the same seed
    _init_weights(ours)
    by_init = full_params(ours)
    second = _meta_sharded(strategy)
    second.to_empty(device="cpu")
    _init_weights(second)
    again = full_params(second)
    _reset_parameters(second)
    by_reset = full_params(second)
    plain_init = _unsharded_on_meta_then(_init_weights)
    plain_reset = _unsharded_on_meta_then(_reset_parameters)
    # rank 0's full state dict, loaded into the shards; then 3 steps beside DDP
    reference = llama(seed=rank)
    full_state = reference.state_dict() if rank == 0 else {}
    set_model_state_dict(
        ours,
        full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    ddp = DDP(copy.deepcopy(reference))
    opt_ours = torch.optim.SGD(ours.parameters(), lr=LR)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=LR)
    grad_diffs = []
    for step in range(STEPS):
        x = tokens(step, rank)
        for model in (ours, ddp):
            lm_loss(model, x).backward()
        grad_diffs.append(shard_grad_diff(ours, ddp.module))
        for opt in (opt_ours, opt_ddp):
            opt.step()
            opt.zero_grad(set_to_none=True)
    gathered = full_params(ours)
    return {
        "meta_forward": meta_forward,
        "setup_nodes": setup,
        "locals_in_shards": locals_in_shards,
        "shard_bytes": shard_bytes,
        "model_bytes": model_bytes,
        "world": world,
        "alignment": alignment,
        "init_equal": all(torch.equal(by_init[n], t) for n, t in plain_init.items()),
        "init_deterministic": all(torch.equal(by_init[n], again[n]) for n in by_init),
        "init_spread": by_init["model.embed_tokens.weight"].std().item(),
        # (RMSNorm has no reset_parameters: its weights stay as to_empty left them)
        "reset_equal": all(
            torch.equal(by_reset[n], t) for n, t in plain_reset.items() if "norm" not in n
        ),
        "grad_diffs": grad_diffs,
        "diff": max(
            (gathered[n] - p.detach()).abs().max().item() for n, p in ddp.module.named_parameters()
        ),
    }


# -- the model's own methods ------------------------------------------------------------
def _methods() -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    rank = dist.get_rank()
    plain = llama(seed=0)  # rank 0's weights: what every rank's shards hold after the wrap
    ours = lamina.distribute(llama(seed=rank), "zero3", min_unit_numel=0)
    out: dict[str, Any] = {}
    # before the first forward
    out["state_dict_keys"] = list(ours.state_dict()) == list(plain.state_dict())
    ours.eval()
    out["eval"] = not any(m.training for m in ours.modules())
    ours.train()
    moved = ours.to("cpu")
    engine = ours.lamina_engine  # type: ignore[union-attr]
    shards = {u.shard.untyped_storage().data_ptr() for u in engine.units}
    out["to_same"] = moved is ours and all(
        p.to_local().untyped_storage().data_ptr() in shards for p in ours.parameters()
    )
    try:
        ours.to(torch.float64)
        out["to_dtype"] = "no error"
    except ConfigError as exc:
        out["to_dtype"] = str(exc)
    # generate: sharded (units gathered per forward), and on the whole parameters
    prompt = tokens(0, 0)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    want = plain.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    got = ours.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)  # type: ignore[operator]
    with ours.full_parameters():  # type: ignore[operator]
        whole = ours.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)  # type: ignore[operator]
        try:
            ours(input_ids=prompt)
            out["grad_forward_inside"] = "no error"
        except ConfigError as exc:
            out["grad_forward_inside"] = str(exc)
    out["generate"] = torch.equal(got, want) and torch.equal(whole, want)
    out["generated"] = want.shape[1] - prompt.shape[1]
    # save_pretrained: one line outside full_parameters(), rank 0 writes inside it
    folder = tempfile.mkdtemp(prefix="lamina-save-")
    try:
        ours.save_pretrained(folder)  # type: ignore[operator]
        out["save_outside"] = "no error"
    except ConfigError as exc:
        out["save_outside"] = str(exc)
    with ours.full_parameters():  # type: ignore[operator]
        ours.save_pretrained(folder)  # type: ignore[operator]
    out["files"] = sorted(os.listdir(folder))
    whole_params = full_params(ours)
    if rank == 0:
        loaded = LlamaForCausalLM.from_pretrained(folder)
        out["loaded_equal"] = all(
            torch.equal(whole_params[n], p) for n, p in loaded.named_parameters()
        )
    # writeback: a change made inside the block persists only when asked
    for writeback in (False, True):
        with ours.full_parameters(writeback=writeback), torch.no_grad():  # type: ignore[operator]
            ours.lm_head.weight.mul_(2.0)  # type: ignore[union-attr,operator]
        after = full_params(ours)["lm_head.weight"]
        factor = 2.0 if writeback else 1.0
        out[f"writeback_{writeback}"] = torch.equal(after, whole_params["lm_head.weight"] * factor)
    # load_state_dict of a full (unsharded) state dict on every rank: each loads its rows
    other = llama(seed=3)
    missing = ours.load_state_dict(other.state_dict())
    loaded_params = full_params(ours)
    out["full_load"] = not missing.missing_keys and all(
        torch.equal(loaded_params[n], p) for n, p in other.named_parameters()
    )
    try:
        ours.load_state_dict(other.state_dict(), assign=True)
        out["assign"] = "no error"
    except ConfigError as exc:
        out["assign"] = str(exc)
    out["held"] = [u.layout.name for u in engine.units if u.full is not None]
    return out


def _lora_adapters_load_back(result_model: nn.Module) -> bool:
    """The trained adapters saved by peft inside ``full_parameters()`` load back with peft
    onto a fresh base (rank 0 writes and reads)."""
    from peft import PeftModel

    folder = tempfile.mkdtemp(prefix="lamina-adapters-")
    with result_model.full_parameters():  # type: ignore[operator]
        result_model.save_pretrained(folder)  # type: ignore[operator]
    trained = {n: t for n, t in full_params(result_model).items() if "lora_" in n}
    if dist.get_rank() != 0:
        return os.listdir(folder) == []  # only rank 0 wrote
    loaded = dict(PeftModel.from_pretrained(llama(seed=5), folder).named_parameters())
    return bool(trained) and all(torch.equal(loaded[n], t) for n, t in trained.items())


def _lora_with_save() -> dict[str, Any]:
    rank = dist.get_rank()
    initial = _lora(rank)
    ours = lamina.distribute(copy.deepcopy(initial), "zero3", min_unit_numel=0)
    x = tokens(0, rank)
    lm_loss(ours, x).backward()
    torch.optim.SGD(ours.parameters(), lr=LR).step()
    return {"adapters_load_back": _lora_adapters_load_back(ours)}


# -- the jobs -------------------------------------------------------------------------------
def _two_rank_job() -> dict[str, Any]:
    lamina.init()
    results: dict[str, Any] = {
        "frozen-root-and-layer": _compare(_frozen_root_and_layer, "zero3"),
        "trained-head": _compare(_trained_head, "zero3"),
        "hf-checkpointing": _compare(_hf_checkpointed, "zero3"),
        "hf-checkpointing-after": _compare(llama, "zero3", after=_hf_checkpointing),
        "hf-checkpointing-merged": _compare(_hf_checkpointed, "zero3", min_unit_numel=1 << 16),
        "checkpoint-wrapper": _compare(_wrapped_layers, "zero3"),
        "meta": _meta_flow("zero3"),
        "methods": _methods(),
    }
    if _has_peft():
        results["lora"] = _compare(_lora, "zero3")
        results["prompt"] = _compare(_prompt, "zero3")
        results["lora-save"] = _lora_with_save()
    return results


def _hsdp_job() -> dict[str, Any]:
    lamina.init(mesh="topology")
    results: dict[str, Any] = {
        "hf-checkpointing": _compare(_hf_checkpointed, "hsdp"),
        "meta": _meta_flow("hsdp"),
    }
    if _has_peft():
        results["lora"] = _compare(_lora, "hsdp")
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_two_rank_job, 2, timeout=300)


@pytest.fixture(scope="module")
def hsdp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = tmp_path_factory.mktemp("finetune") / "two_hosts_of_two.json"
    path.write_text(json.dumps(two_hosts_of_two()))
    return run_ranks(_hsdp_job, 4, env={"LAMINA_TOPOLOGY": str(path)}, timeout=300)


def _assert_equal_to_ddp(results: list[dict[str, Any]]) -> None:
    assert results[1]["started_apart"], results[1]  # only the broadcast makes them agree
    for result in results:
        assert max(result["grad_diffs"]) <= GRAD_TOLERANCE, result["grad_diffs"]
        assert result["diff"] <= PARAM_TOLERANCE, result["diff"]
        assert result["names"] and result["moved"] > 1e-4, result
        assert result["held"] == [], result  # nothing stays gathered between steps


def _need_peft() -> None:
    pytest.importorskip("peft", reason="LoRA and prompt tuning come from peft (examples extra)")


# -- frozen-heavy models --------------------------------------------------------------------
@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", ["zero3", "hsdp"])
def test_lora_trains_equal_to_ddp_with_a_frozen_root_unit(
    strategy: str, two_ranks: list[dict[str, Any]], hsdp_ranks: list[dict[str, Any]]
) -> None:
    _need_peft()
    results = [r["lora"] for r in (two_ranks if strategy == "zero3" else hsdp_ranks)]
    _assert_equal_to_ddp(results)
    result = results[0]
    assert result["trained"] and all("lora_" in n for n in result["trained"]), result
    # the root (embeddings, norm, head) is all frozen: gathered, never reduce-scattered
    assert result["frozen_units"] == "(root)", result
    assert "(root)" not in result["scatters"] and len(result["scatters"]) == 2, result
    assert "(root).gather.fwd" in result["issued"], result
    assert not any(n.startswith("(root).") and "scatter" in n for n in result["issued"])


@pytest.mark.timeout(360)
def test_prompt_tuning_gathers_frozen_layer_units_for_backward(
    two_ranks: list[dict[str, Any]],
) -> None:
    _need_peft()
    results = [r["prompt"] for r in two_ranks]
    _assert_equal_to_ddp(results)
    result = results[0]
    assert result["trained"] == ["prompt_encoder.default.embedding.weight"], result
    assert result["scatters"] == ["(root)"], result  # only the root has a trained parameter
    frozen = result["frozen_units"].split(",")
    assert len(frozen) == 4 and all("layers" in u for u in frozen), result
    # backward runs through the frozen layers to the prompt: their weights are gathered
    # again (the first layer's; the last one is kept from its forward)
    assert any(n.endswith("layers.0.gather.bwd") for n in result["issued"]), result
    # ... and freed once backward has passed them: at most the root, the last layer (kept
    # from its forward), the layer backward is in and the one prefetched before it, never
    # all five units
    assert 0 < result["most_gathered_in_backward"] <= 4, result


@pytest.mark.timeout(360)
def test_frozen_root_and_frozen_layer_units_without_peft(two_ranks: list[dict[str, Any]]) -> None:
    results = [r["frozen-root-and-layer"] for r in two_ranks]
    _assert_equal_to_ddp(results)
    result = results[0]
    assert result["frozen_units"] == "(root),model.layers.0", result
    assert result["scatters"] == ["model.layers.1"], result
    assert all(n.startswith("model.layers.1.") for n in result["trained"]), result


@pytest.mark.timeout(360)
def test_frozen_backbone_with_a_trained_head(two_ranks: list[dict[str, Any]]) -> None:
    results = [r["trained-head"] for r in two_ranks]
    _assert_equal_to_ddp(results)
    result = results[0]
    assert result["trained"] == ["lm_head.weight"], result
    assert result["scatters"] == ["(root)"], result
    # no backward reaches the frozen layers: neither is gathered for it
    assert not any(".gather.bwd" in n for n in result["issued"]), result


# -- activation checkpointing -----------------------------------------------------------------
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("case", "strategy"),
    [
        ("hf-checkpointing", "zero3"),
        ("hf-checkpointing-after", "zero3"),
        ("hf-checkpointing-merged", "zero3"),
        ("checkpoint-wrapper", "zero3"),
        ("hf-checkpointing", "hsdp"),
    ],
)
def test_activation_checkpointing_recomputes_and_equals_ddp(
    case: str,
    strategy: str,
    two_ranks: list[dict[str, Any]],
    hsdp_ranks: list[dict[str, Any]],
) -> None:
    results = [r[case] for r in (two_ranks if strategy == "zero3" else hsdp_ranks)]
    _assert_equal_to_ddp(results)
    for result in results:
        # layer 0's MLP ran in the forward and again when backward recomputed it
        assert result["mlp_forwards_per_step"] == 2, result
    if case == "hf-checkpointing-merged":  # both layers in one unit, gathered all forward
        assert [u for u in results[0]["units"] if "layers" in u] == [
            "model.layers.0..model.layers.1"
        ], results[0]


# -- meta-device initialization ---------------------------------------------------------------
@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", ["zero3", "hsdp"])
def test_meta_device_to_empty_init_and_load_then_train_equal_to_ddp(
    strategy: str, two_ranks: list[dict[str, Any]], hsdp_ranks: list[dict[str, Any]]
) -> None:
    results = [r["meta"] for r in (two_ranks if strategy == "zero3" else hsdp_ranks)]
    for result in results:
        assert result["meta_forward"].startswith("this LlamaForCausalLM is on the meta")
        assert "to_empty" in result["meta_forward"] and "\n" not in result["meta_forward"]
        assert result["setup_nodes"] == [], result  # nothing to broadcast on meta
        # to_empty materialized only this rank's shards: every parameter is a view of them
        assert result["locals_in_shards"], result
        share = result["model_bytes"] / result["world"]
        assert share <= result["shard_bytes"] <= share + result["alignment"], result
        # initializers on the shards: bit for bit the unsharded model's from the same seed
        assert result["init_equal"] and result["reset_equal"], result
        assert result["init_deterministic"] and result["init_spread"] > 0.01, result
        assert max(result["grad_diffs"]) <= GRAD_TOLERANCE, result["grad_diffs"]
        assert result["diff"] <= PARAM_TOLERANCE, result["diff"]


# -- the model's own methods -------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_generate_state_dict_load_to_and_modes_work_before_and_without_a_training_step(
    two_ranks: list[dict[str, Any]],
) -> None:
    for result in (r["methods"] for r in two_ranks):
        assert result["state_dict_keys"] and result["eval"] and result["to_same"], result
        assert result["to_dtype"].startswith("a zero3 model keeps its shards in the dtype")
        assert result["generate"] and result["generated"] == 4, result
        assert "torch.no_grad()" in result["grad_forward_inside"], result
        # a full state dict loads into the shards; assign=True is one line
        assert result["full_load"], result
        assert result["assign"].startswith("load_state_dict(assign=True) would replace")
        assert "\n" not in result["assign"], result
        assert result["held"] == [], result


@pytest.mark.timeout(360)
def test_save_pretrained_needs_full_parameters_and_loads_back(
    two_ranks: list[dict[str, Any]],
) -> None:
    rank0, rank1 = (r["methods"] for r in two_ranks)
    for result in (rank0, rank1):
        message = result["save_outside"]
        assert "full_parameters()" in message and "\n" not in message, message
        assert result["writeback_False"] and result["writeback_True"], result
    assert "model.safetensors" in rank0["files"] and rank1["files"] == [], (rank0, rank1)
    assert rank0["loaded_equal"], rank0


@pytest.mark.timeout(360)
def test_peft_adapters_saved_under_zero3_load_back(two_ranks: list[dict[str, Any]]) -> None:
    _need_peft()
    assert all(r["lora-save"]["adapters_load_back"] for r in two_ranks)
