"""Issue 26's acceptance: real fine-tuning scripts run unchanged under dp, zero3 and hsdp.

Each case trains a tiny Hugging Face ``LlamaForCausalLM`` (hidden 32, 2 layers, vocab 64)
with one fine-tuning feature under a lamina strategy and under torch DDP with the same
feature, from rank-seeded weights (only the wrap-time broadcast makes the ranks agree),
3 SGD steps; the parameters must agree within 1e-6, and the trained ones must have moved.
The features: LoRA through peft (the root unit, embeddings, norm and head, holds only
frozen weights); activation checkpointing as transformers does it, enabled after
distribute, both through the model's own ``gradient_checkpointing_enable`` and with each
decoder layer's ``__call__`` wrapped (the recompute is counted); gradient accumulation
opening with ``no_sync()`` (dp); and a model built on the meta device, ``to_empty``, a
full state dict loaded (zero3, hsdp; each rank then holds at most 1/N of the parameters
plus alignment). dp must also leave the model its own class and state-dict keys. zero3
and hsdp make one unit per decoder layer (``min_unit_numel=0``). One module-scoped 2-rank
job runs every 2-rank case, one 4-rank job on a declared 2 x 2 topology the hsdp ones;
every case reports its own error, so each test fails for its case alone. Last,
``examples/finetune_lora.py`` trains on the harness's ranks (``examples_on_ranks.py``:
torchrun's environment, transformers and peft already imported) and its adapters load
back with ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import lamina
from examples_on_ranks import run_example
from lamina.testing import run_ranks
from models_for_tests import full_params, tiny_llama  # also puts examples/ on sys.path
from topologies_for_tests import two_hosts_of_two

# isort: split
from _stdlib_corpus import load_char_corpus, sample_batch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

# transformers and peft are imported where used (3 s of every xdist worker's collection)
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        find_spec("transformers") is None,
        reason="the fine-tuning tests train a transformers Llama (examples extra)",
    ),
    pytest.mark.skipif(
        find_spec("peft") is None,
        reason="the fine-tuning tests train LoRA adapters through peft (examples extra)",
    ),
]

#: fp32 rounding order only: two ranks sum in one order (a + b == b + a), four in another
#: than DDP's; a lost or doubled gradient contribution moves a parameter by >= 1e-3 here.
TOLERANCE = 1e-6
STEPS, LR = 3, 0.1
#: The smallest movement of the trained parameters that counts as training (LR x a gradient).
MOVED = 1e-4
#: zero3/hsdp: one unit per decoder layer, so the root unit (embeddings, norm, head) is
#: a unit of its own, frozen-only under LoRA.
SHARDED = {"min_unit_numel": 0}
#: The shard buffers' alignment (zero3's default ``alignment_bytes``).
ALIGNMENT_BYTES = 512
#: Ranks each rank's shards span: 2 under zero3 on 2 ranks and under hsdp on 2 x 2.
SHARD_WORLD = 2
#: The forms of activation checkpointing transformers has wrapped its decoder layers in:
#: the model's own ``gradient_checkpointing_enable`` (transformers 5 checkpoints each
#: layer's ``forward``, its module hooks outside), and each layer's ``__call__`` wrapped,
#: module hooks inside (transformers 4's loop called ``checkpoint(layer.__call__, ...)``).
CHECKPOINTING = ("method", "call")
#: Which strategies the example test runs: dp in the test sessions; the ``finetune`` nox
#: session sets ``LAMINA_FINETUNE_STRATEGIES=dp,zero3,hsdp``.
EXAMPLE_STRATEGIES = os.environ.get("LAMINA_FINETUNE_STRATEGIES", "dp").split(",")


# -- models, batches, training ----------------------------------------------------------
def llama(seed: int) -> LlamaForCausalLM:
    """The tiny Llama, initialized from ``seed``."""
    model: LlamaForCausalLM = tiny_llama(seed, use_cache=False)  # type: ignore[assignment]
    return model


def lora_llama(seed: int) -> nn.Module:
    """The tiny Llama with LoRA adapters on q_proj and v_proj (every base weight frozen)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model: nn.Module = get_peft_model(llama(seed), config)
    return model


def tokens(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    """This rank's batch at ``step`` (microbatch ``micro``)."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 64, (2, 8), generator=generator)


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss (transformers shifts the labels)."""
    loss: torch.Tensor = model(input_ids=x, labels=x).loss
    return loss


def sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)


def train(model: nn.Module, rank: int, accumulate: bool) -> None:
    """``STEPS`` SGD steps; with ``accumulate`` two microbatches per step, the first
    inside ``model.no_sync()`` (DDP's and Accelerate's pattern, from the first step)."""
    optimizer = sgd(model)
    for step in range(STEPS):
        if accumulate:
            with model.no_sync():  # type: ignore[operator]
                (lm_loss(model, tokens(step, rank, micro=1)) / 2).backward()
            (lm_loss(model, tokens(step, rank)) / 2).backward()
        else:
            lm_loss(model, tokens(step, rank)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def whole_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name (shards gathered: every rank calls it)."""
    return full_params(model)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def enable_checkpointing(model: nn.Module, form: str) -> None:
    """Recompute every decoder layer in backward (non-reentrant ``torch.utils.checkpoint``)
    in one of the forms of ``CHECKPOINTING``."""
    if form == "method":
        model.activation_checkpointing_enable(  # type: ignore[operator]
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
        return
    for layer in decoder_layers(model):
        checkpoint_calls(layer)


def checkpoint_calls(layer: nn.Module) -> None:
    """Wrap ``layer.__call__``, its hooks included, in ``torch.utils.checkpoint`` (as
    transformers 4's decoder loop did), by extending the layer's class."""
    base = type(layer)

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super(wrapped, self).__call__, *args, use_reentrant=False, **kwargs)

    wrapped = type(f"CallCheckpointed{base.__name__}", (base,), {"__call__": call})
    layer.__class__ = wrapped


def count_recomputes(model: nn.Module) -> list[int]:
    """A counter of the first decoder layer's MLP forwards on real tensors: once per
    forward, and once more per backward when the layer is recomputed (dp's graph capture
    traces the first forward on fake tensors: that trace does not count)."""
    calls = [0]

    def count(_module: nn.Module, args: tuple[Any, ...]) -> None:
        if type(args[0]) is torch.Tensor:
            calls[0] += 1

    decoder_layers(model)[0].mlp.register_forward_pre_hook(count)
    return calls


# -- the cases --------------------------------------------------------------------------
def against_ddp(
    make: Callable[[int], nn.Module],
    strategy: str,
    rank: int,
    *,
    checkpointing: str | None = None,
    accumulate: bool = False,
) -> dict[str, Any]:
    """Train ``make(rank)`` under ``strategy`` and under DDP with the same feature; the
    largest parameter difference, how far training moved the trained weights, and
    whether this rank started apart from rank 0."""
    options = SHARDED if strategy != "dp" else {}
    ours = lamina.distribute(make(rank), strategy, **options)
    ddp = DDP(make(rank))
    calls = [0]
    if checkpointing is not None:  # after distribute: the model's own method must be there
        enable_checkpointing(ours, checkpointing)
        enable_checkpointing(ddp.module, checkpointing)
        calls = count_recomputes(ours)
    train(ours, rank, accumulate)
    train(ddp, rank, accumulate)
    got = whole_params(ours)
    start = dict(make(0).named_parameters())
    trained = [n for n, p in ddp.module.named_parameters() if p.requires_grad]
    return {
        "diff": max((got[n] - p).abs().max().item() for n, p in ddp.module.named_parameters()),
        "names": sorted(got) == sorted(n for n, _ in ddp.module.named_parameters()),
        "moved": max((got[n] - start[n]).abs().max().item() for n in trained),
        "started_apart": any(
            not torch.equal(p, start[n]) for n, p in make(rank).named_parameters()
        ),
        "mlp_calls": calls[0],
    }


def parameter_bytes(model: nn.Module) -> tuple[int, list[str]]:
    """Bytes of this rank's parameter storage (each storage once) and the parameters or
    buffers still on the meta device."""
    storages: dict[int, int] = {}
    on_meta = []
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_meta:
            on_meta.append(name)
        elif isinstance(tensor, nn.Parameter):
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), on_meta


def meta_init(strategy: str, rank: int) -> dict[str, Any]:
    """Build on meta, distribute, ``to_empty``, initialize (transformers' ``init_weights``
    also fills the rotary buffers, which no state dict holds), load rank 0's full state
    dict (``broadcast_from_rank0``: the other ranks pass none), then train against DDP
    of the model built on the CPU (rank-seeded: DDP takes rank 0's)."""
    with torch.device("meta"):
        model = llama(rank)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = lamina.distribute(model, strategy, **SHARDED)
    model.to_empty(device="cpu")
    held, on_meta = parameter_bytes(model)
    units = len(model.lamina_layout.units)  # type: ignore[union-attr]
    model.init_weights()  # type: ignore[operator]
    full = llama(0).state_dict() if rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    ddp = DDP(llama(rank))
    train(model, rank, accumulate=False)
    train(ddp, rank, accumulate=False)
    got = whole_params(model)
    start = dict(llama(0).named_parameters())
    return {
        "diff": max((got[n] - p).abs().max().item() for n, p in ddp.module.named_parameters()),
        "moved": max((got[n] - start[n]).abs().max().item() for n in start),
        "held": held,
        "bound": full_bytes // SHARD_WORLD + units * ALIGNMENT_BYTES,
        "full_bytes": full_bytes,
        "on_meta": on_meta,
    }


def in_place(rank: int) -> dict[str, Any]:
    """``lamina.distribute(model, "dp")`` keeps the model's class and state-dict keys
    (checked before the first forward, as a script saving or loading first would)."""
    from transformers import LlamaForCausalLM

    model = llama(rank)
    keys = list(model.state_dict())
    distributed = lamina.distribute(model, "dp")
    return {
        "isinstance": isinstance(distributed, LlamaForCausalLM),
        "same_keys": list(distributed.state_dict()) == keys,
    }


def run_case(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The case's result, or the error it raised (so each test reports its own case)."""
    try:
        return {"error": None, **case()}
    except Exception as exc:  # reported by the test of this case
        return {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}


def _two_rank_job() -> dict[str, dict[str, Any]]:
    rank = lamina.init().rank
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "in_place/dp": lambda: in_place(rank),
        "no_sync_first/dp": lambda: against_ddp(llama, "dp", rank, accumulate=True),
        "meta/zero3": lambda: meta_init("zero3", rank),
    }
    for strategy in ("dp", "zero3"):
        cases[f"lora/{strategy}"] = lambda s=strategy: against_ddp(lora_llama, s, rank)
        for form in CHECKPOINTING:
            cases[f"checkpointing-{form}/{strategy}"] = lambda s=strategy, f=form: against_ddp(
                llama, s, rank, checkpointing=f
            )
    return {name: run_case(case) for name, case in cases.items()}


def _hsdp_job() -> dict[str, dict[str, Any]]:
    rank = lamina.init(mesh="topology").rank
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "lora/hsdp": lambda: against_ddp(lora_llama, "hsdp", rank),
        "meta/hsdp": lambda: meta_init("hsdp", rank),
    }
    for form in CHECKPOINTING:
        cases[f"checkpointing-{form}/hsdp"] = lambda f=form: against_ddp(
            llama, "hsdp", rank, checkpointing=f
        )
    return {name: run_case(case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_two_rank_job, 2, timeout=280)


@pytest.fixture(scope="module")
def hsdp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    path = tmp_path_factory.mktemp("finetuning") / "two_hosts_of_two.json"
    path.write_text(json.dumps(two_hosts_of_two()))
    return run_ranks(_hsdp_job, 4, env={"LAMINA_TOPOLOGY": str(path)}, timeout=280)


def results_of(request: pytest.FixtureRequest, case: str) -> list[dict[str, Any]]:
    """Every rank's result of ``case`` (from the job of its strategy); fails on an error."""
    job = "hsdp_ranks" if case.endswith("/hsdp") else "two_ranks"
    per_rank = [results[case] for results in request.getfixturevalue(job)]
    for rank, result in enumerate(per_rank):
        assert result["error"] is None, f"{case} on rank {rank}: {result['error']}"
    return per_rank


def assert_equals_ddp(per_rank: list[dict[str, Any]]) -> None:
    """Trained, from weights that started apart, to DDP's parameters on every rank."""
    assert all(r["started_apart"] for r in per_rank[1:]), "the ranks did not start apart"
    assert all(r["names"] for r in per_rank), "parameter names differ from the model's"
    assert min(r["moved"] for r in per_rank) > MOVED, per_rank
    assert max(r["diff"] for r in per_rank) <= TOLERANCE, per_rank


# -- the acceptance tests -----------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["dp", "zero3", "hsdp"])
def test_lora_through_peft_equals_ddp(request: pytest.FixtureRequest, strategy: str) -> None:
    assert_equals_ddp(results_of(request, f"lora/{strategy}"))


@pytest.mark.parametrize("form", CHECKPOINTING)
@pytest.mark.parametrize("strategy", ["dp", "zero3", "hsdp"])
def test_transformers_checkpointing_equals_ddp(
    request: pytest.FixtureRequest, strategy: str, form: str
) -> None:
    per_rank = results_of(request, f"checkpointing-{form}/{strategy}")
    assert_equals_ddp(per_rank)
    # every step ran the first layer's MLP twice: in the forward, and recomputed in backward
    assert [r["mlp_calls"] for r in per_rank] == [2 * STEPS] * len(per_rank)


def test_accumulation_opening_with_no_sync_equals_ddp(request: pytest.FixtureRequest) -> None:
    assert_equals_ddp(results_of(request, "no_sync_first/dp"))


@pytest.mark.parametrize("strategy", ["zero3", "hsdp"])
def test_meta_init_to_empty_and_full_state_dict_equals_ddp(
    request: pytest.FixtureRequest, strategy: str
) -> None:
    per_rank = results_of(request, f"meta/{strategy}")
    for rank, result in enumerate(per_rank):
        assert result["on_meta"] == [], f"rank {rank}: still on meta: {result['on_meta']}"
        # to_empty materialized this rank's shards only, not the whole model
        assert 0 < result["held"] <= result["bound"] < result["full_bytes"], result
    assert min(r["moved"] for r in per_rank) > MOVED, per_rank
    assert max(r["diff"] for r in per_rank) <= TOLERANCE, per_rank


def test_dp_keeps_the_model_class_and_state_dict_keys(request: pytest.FixtureRequest) -> None:
    for result in results_of(request, "in_place/dp"):
        assert result["isinstance"], "lamina.distribute(model, 'dp') is not a LlamaForCausalLM"
        assert result["same_keys"], "state_dict() keys differ from the model's"


# -- the example ------------------------------------------------------------------------
EXAMPLE_ARGS = ("--max-steps", "10", "--batch-size", "4", "--seq-len", "32")
EXAMPLE_ARGS += ("--hidden-size", "64", "--corpus-mb", "0.2", "--log-every", "5")
EXAMPLE_ARGS += ("--eval-batches", "2", "--lr", "5e-2")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", EXAMPLE_STRATEGIES)
def test_finetune_example_trains_and_its_adapters_load_with_peft(
    tmp_path: Path, strategy: str
) -> None:
    """The example on 2 ranks (hsdp 4 on 2 x 2) with accumulation and
    checkpointing (zero3/hsdp: also meta init): the validation loss falls, and the saved
    adapters, loaded back onto the saved base, give a lower loss than the base alone."""
    ranks, env = 2, {}
    extra = ["--grad-accum", "2", "--gradient-checkpointing"]
    if strategy != "dp":
        extra.append("--meta-init")
    if strategy == "hsdp":
        topology = tmp_path / "two_hosts.json"
        topology.write_text(json.dumps(two_hosts_of_two()))
        ranks, env = 4, {"LAMINA_TOPOLOGY": str(topology)}
    output = tmp_path / "adapters"
    result = run_example(
        "finetune_lora.py",
        *EXAMPLE_ARGS,
        *extra,
        "--strategy",
        strategy,
        "--output",
        str(output),
        ranks=ranks,
        env=env,
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done = re.search(
        r"done: 10 steps \| train loss [\d.]+ -> [\d.]+ \| val loss ([\d.]+) -> "
        r"([\d.]+)",
        result.stdout,
    )
    assert done, result.stdout
    before, after = map(float, done.groups())
    assert after < before - 0.1, result.stdout
    assert f"adapters saved to {output}" in result.stdout

    from peft import PeftModel
    from transformers import LlamaForCausalLM

    corpus = load_char_corpus(0.2)
    x, y = sample_batch(corpus.val, 8, 32, torch.Generator().manual_seed(0))
    base = LlamaForCausalLM.from_pretrained(str(output / "base"))
    model = PeftModel.from_pretrained(base, str(output)).eval()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 4 and all(p.abs().max() > 0 for p in lora_b)  # trained from 0

    def loss() -> float:
        with torch.no_grad():
            logits = model(input_ids=x).logits
            return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))

    adapted = loss()
    with model.disable_adapter():
        plain = loss()
    assert adapted < plain - 0.1, (adapted, plain)
