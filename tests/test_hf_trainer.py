"""Issue 47: an unchanged ``transformers.Trainer`` (and TRL's ``SFTTrainer``) trains on
lamina's strategies (``lamina.integrations.hf``).

The mapping of Accelerate's ``ParallelismConfig`` onto a lamina mesh and strategy list is
a pure function, tested one size at a time, refusals included. Then one module-scoped
2-rank job and one 4-rank job train the tests' tiny transformers Llama (hidden 32, 2
layers, grouped-query attention) for 4 AdamW steps on an in-memory dataset read in order
(``train_sampling_strategy="sequential"``), every case reporting its own error:

- 2 ranks: ``LaminaTrainer`` under dp against lamina's own loop (``lamina.distribute`` +
  torch AdamW + the same linear schedule, each data replica reading the batches
  Accelerate gives it) and against plain ``Trainer`` (Accelerate's DDP), with and without
  gradient accumulation (Trainer's ``no_sync`` around all but the last microbatch);
  under zero3 against lamina's loop; a zero3 run resumed from its step-2 checkpoint
  against the uninterrupted one, and from that checkpoint's whole weights only;
  ``save_model`` loaded back by ``from_pretrained``; TRL's ``SFTTrainer`` through
  ``lamina_trainer`` (zero3) against ``LaminaTrainer``; and the one-line refusals a
  Trainer can meet (pp, two spellings at once, a mesh other than the job's).
- 4 ranks: ``["tp", "zero3"]`` on ``{"fsdp": 2, "tp": 2}`` against lamina's loop, resumed
  from its step-2 checkpoint, saved and loaded back; and
  ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` against lamina's own spelling.

Where two paths give equal numbers, the test also asserts that lamina ran: no DDP
wrapper, the strategy in the model's plan, DTensor shards, each parameter's placement
and the data replicas. Last, ``examples/hf_trainer_llama.py`` trains on 2 harness
ranks, and a second run resumed from its step-3 checkpoint prints the same losses.
"""

from __future__ import annotations

import re
import shutil
import traceback
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

import lamina
from examples_on_ranks import run_example
from lamina.errors import ConfigError
from lamina.integrations.hf.parallelism import LaminaParallelism, LaminaPlan
from lamina.testing import run_ranks

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        find_spec("transformers") is None or find_spec("accelerate") is None,
        reason="the Trainer integration needs transformers and accelerate (hf extra)",
    ),
]

#: Rows per rank per step, tokens per row, optimizer steps, peak learning rate.
BATCH, SEQ, STEPS, LR = 2, 16, 4, 1e-2
#: The tiny Llama's vocabulary (``models_for_tests.tiny_llama``).
VOCAB = 64
#: Two paths that compute the same losses differently (a fused or a foreach AdamW, the
#: loss normalized per rank or over the global token count, another all-reduce order)
#: agree to fp32 rounding, ~1e-7 here; a lost or doubled contribution moves it by >= 1e-3.
TOLERANCE = 1e-5
#: The step the resumed runs start from (their checkpoint).
RESUME_AT = 2


# -- the mapping, one process ---------------------------------------------------------------
#: Accelerate's sizes, the lamina mesh and the strategies they map onto.
MAPPING = [
    ({}, {"dp": 1}, "dp"),
    ({"dp_replicate_size": 4}, {"dp": 4}, "dp"),
    ({"dp_shard_size": 4}, {"fsdp": 4}, "zero3"),
    ({"dp_replicate_size": 2, "dp_shard_size": 2}, {"dp": 2, "fsdp": 2}, "hsdp"),
    ({"tp_size": 2}, {"tp": 2}, "tp"),
    ({"dp_shard_size": 2, "tp_size": 2}, {"fsdp": 2, "tp": 2}, ("tp", "zero3")),
    ({"dp_replicate_size": 2, "tp_size": 2}, {"dp": 2, "fsdp": 1, "tp": 2}, ("tp", "hsdp")),
    (
        {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2},
        {"dp": 2, "fsdp": 2, "tp": 2},
        ("tp", "hsdp"),
    ),
]
#: lamina's own sizes Accelerate lacks (the pipeline), and what they map onto.
PIPELINED = [
    ({"pp": 4}, {"pp": 4}, "pp"),
    ({"pp": 2, "dp_replicate": 2}, {"pp": 2, "dp": 2}, "pp"),
    ({"pp": 2, "dp_shard": 2}, {"pp": 2, "fsdp": 2}, ("pp", "zero3")),
    ({"pp": 2, "tp": 2, "dp_replicate": 2}, {"pp": 2, "dp": 2, "tp": 2}, ("pp", "tp")),
    (
        {"pp": 2, "tp": 2, "dp_shard": 2, "dp_replicate": 2},
        {"pp": 2, "dp": 2, "fsdp": 2, "tp": 2},
        ("pp", "tp", "hsdp"),
    ),
]


@pytest.mark.parametrize(("sizes", "mesh", "strategy"), MAPPING)
def test_parallelism_config_maps_onto_a_lamina_mesh_and_strategy_list(
    sizes: dict[str, int], mesh: dict[str, int], strategy: str | tuple[str, ...]
) -> None:
    from accelerate import ParallelismConfig

    parallelism = LaminaParallelism.from_accelerate(ParallelismConfig(**sizes))
    plan = parallelism.plan()
    assert (plan.mesh, plan.strategy) == (mesh, strategy)
    assert list(plan.mesh) == [a for a in ("dp", "fsdp", "tp") if a in mesh]  # tp innermost
    product = 1
    for size in mesh.values():
        product *= size
    assert parallelism.world_size == product
    # hsdp alone names its axes (its default is a topology's inter x intra)
    assert (plan.shard, plan.replicate) == (
        (("fsdp",), ("dp",)) if strategy == "hsdp" else ((), ())
    )


@pytest.mark.parametrize(("sizes", "mesh", "strategy"), PIPELINED)
def test_lamina_sizes_put_the_pipeline_on_the_outermost_axis(
    sizes: dict[str, int], mesh: dict[str, int], strategy: str | tuple[str, ...]
) -> None:
    plan = LaminaParallelism(**sizes).plan()
    assert (plan.mesh, plan.strategy) == (mesh, strategy)
    assert next(iter(plan.mesh)) == "pp"


def test_sizes_without_a_lamina_strategy_are_refused_in_one_line() -> None:
    from accelerate import ParallelismConfig

    for config, words in (
        (
            ParallelismConfig(cp_size=2, dp_shard_size=2),
            "cp_size=2: lamina has no context-parallel",
        ),
        (ParallelismConfig(sp_size=2), "sp_size=2: lamina has no sequence-parallel"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)) as caught:
            LaminaParallelism.from_accelerate(config)
        assert "\n" not in str(caught.value) and "set it to 1" in str(caught.value)
    with pytest.raises(ConfigError, match="ep=2: lamina has no expert-parallel strategy yet"):
        LaminaParallelism(ep=2, dp_shard=2).plan()
    with pytest.raises(ConfigError, match=r"tp=0: give a whole number >= 1"):
        LaminaParallelism(tp=0)
    with pytest.raises(ConfigError, match=r"takes 4 rank\(s\) but the job has 2"):
        LaminaParallelism(dp_shard=2, tp=2).check_world(2)


# -- training, shared by the rank jobs ---------------------------------------------------------
def _rows(count: int) -> list[dict[str, Any]]:
    """``count`` rows of random token ids, the labels the inputs (the model shifts them)."""
    import torch

    ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(1234))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _llama() -> Any:
    from models_for_tests import tiny_llama

    return tiny_llama(0, use_cache=False)


def _args(output_dir: Path, **overrides: Any) -> Any:
    """The tests' TrainingArguments: ``STEPS`` steps of ``BATCH`` rows per data replica,
    the rows in order, a loss logged each step, nothing saved unless asked."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": BATCH,
        "max_steps": STEPS,
        "learning_rate": LR,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "train_sampling_strategy": "sequential",
        "use_cpu": True,
        "seed": 0,
        "log_level": "error",
        **overrides,
    }
    return TrainingArguments(**settings)


def _train(trainer_class: Any, resume: str | None = None, **kwargs: Any) -> tuple[Any, list[float]]:
    """``trainer_class(**kwargs)`` trained (resumed from ``resume``): the trainer and the
    loss it logged at each step."""
    from transformers import PrinterCallback, TrainerCallback

    losses: list[float] = []

    class Record(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs is not None and "loss" in logs:
                losses.append(float(logs["loss"]))

    trainer = trainer_class(callbacks=[Record()], **kwargs)
    trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses


def _lamina_loop(
    data: list[dict[str, Any]], strategy: str | list[str], **options: Any
) -> list[float]:
    """lamina's own loop on the same model, seed and rows: ``lamina.distribute``, torch
    AdamW, Trainer's linear schedule and clipping at 1.0; data replica ``index`` of
    ``count`` reads row block ``step * count + index`` (Accelerate's order). The loss of
    each step, averaged over the ranks."""
    import torch
    import torch.distributed as dist
    from transformers import get_linear_schedule_with_warmup

    model = lamina.distribute(_llama(), strategy, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(optimizer, 0, STEPS)
    index, count = model.data_replica  # type: ignore[misc]
    losses = []
    for step in range(STEPS):
        block = (step * count + index) * BATCH
        x = torch.stack([data[i]["input_ids"] for i in range(block, block + BATCH)])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        model.clip_grad_norm_(1.0)  # type: ignore[operator]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _loads_back(trainer: Any, folder: Path, data: list[dict[str, Any]]) -> dict[str, Any]:
    """``trainer.save_model(folder)``, then rank 0 loads it with ``from_pretrained``: the
    keys it missed and its loss on a batch beside the trained model's (every rank runs
    that forward)."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    trainer.save_model(str(folder))
    dist.barrier()
    x = torch.stack([row["input_ids"] for row in data[:BATCH]])
    with torch.no_grad():
        trained = trainer.model(input_ids=x, labels=x).loss.item()
    if dist.get_rank() != 0:
        return {}
    loaded, info = LlamaForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    with torch.no_grad():
        loss = loaded.eval()(input_ids=x, labels=x).loss.item()
    files = sorted(p.name for p in folder.iterdir())
    return {
        "missing": sorted(info["missing_keys"]),
        "loss": loss,
        "trained": trained,
        "files": files,
    }


def _refused(make: Callable[[], Any]) -> str:
    """The one-line error ``make()`` raises (empty when it raises none)."""
    try:
        make()
    except ConfigError as exc:
        return str(exc)
    return ""


def _case(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The case's result, or the error it raised (so each test reports its own case)."""
    try:
        return {"error": None, **case()}
    except Exception:  # reported by the test of this case
        return {"error": traceback.format_exc()[-3000:]}


# -- 2 ranks ------------------------------------------------------------------------------------
def _dp(tmp: Path, data: list[dict[str, Any]]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Trainer

    from lamina.integrations.hf import LaminaTrainer
    from lamina.strategies.surface import DistributedModule

    ours, losses = _train(
        LaminaTrainer, model=_llama(), args=_args(tmp / "dp"), train_dataset=data, strategy="dp"
    )
    plain, ddp_losses = _train(Trainer, model=_llama(), args=_args(tmp / "ddp"), train_dataset=data)
    # two microbatches a step: the first inside Trainer's accelerator.no_sync(model)
    twice = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": BATCH // 2}
    _, accumulated = _train(
        LaminaTrainer,
        model=_llama(),
        args=_args(tmp / "dp-accumulated", **twice),
        train_dataset=data,
        strategy="dp",
    )
    _, ddp_accumulated = _train(
        Trainer, model=_llama(), args=_args(tmp / "ddp-accumulated", **twice), train_dataset=data
    )
    return {
        "accumulated": accumulated,
        "ddp_accumulated": ddp_accumulated,
        "losses": losses,
        "loop": _lamina_loop(data, "dp"),
        "ddp": ddp_losses,
        "unwrapped": ours.model_wrapped is ours.model
        and not isinstance(ours.model_wrapped, DistributedDataParallel),
        "distributed": isinstance(ours.model, DistributedModule),
        "strategy": ours.model.execution_plan.strategy,
        "plain_wrapper": type(plain.model_wrapped).__name__,
    }


def _zero3(tmp: Path, data: list[dict[str, Any]]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from lamina.integrations.hf import LaminaTrainer

    options = {"min_unit_numel": 0}  # a unit per decoder layer
    args = _args(tmp / "zero3", save_strategy="steps", save_steps=RESUME_AT)
    trainer, losses = _train(
        LaminaTrainer,
        model=_llama(),
        args=args,
        train_dataset=data,
        strategy="zero3",
        strategy_options=options,
    )
    params = list(trainer.model.parameters())
    _, resumed = _train(
        LaminaTrainer,
        resume=str(tmp / "zero3" / f"checkpoint-{RESUME_AT}"),
        model=_llama(),
        args=args,
        train_dataset=data,
        strategy="zero3",
        strategy_options=options,
    )
    # the same checkpoint as whole weights only (as save_only_model=True writes it): the
    # first step's loss after it depends on the weights alone
    weights = tmp / "zero3-weights-only"
    if dist.get_rank() == 0:
        shutil.copytree(
            tmp / "zero3" / f"checkpoint-{RESUME_AT}",
            weights,
            ignore=shutil.ignore_patterns("lamina"),
        )
    dist.barrier()
    _, from_weights = _train(
        LaminaTrainer,
        resume=str(weights),
        model=_llama(),
        args=args,
        train_dataset=data,
        strategy="zero3",
        strategy_options=options,
    )
    return {
        "losses": losses,
        "loop": _lamina_loop(data, "zero3", **options),
        "resumed": resumed,
        "from_weights": from_weights,
        "sharded": all(
            isinstance(p, DTensor)
            and p.placements == (Shard(0),)
            and p.to_local().numel() < p.numel()
            for p in params
            if p.numel() > 1
        ),
        "strategy": trainer.model.execution_plan.strategy,
        "checkpoint": sorted(p.name for p in (tmp / "zero3" / f"checkpoint-{RESUME_AT}").iterdir()),
        "saved": _loads_back(trainer, tmp / "zero3-final", data),
    }


def _sft(tmp: Path, data: list[dict[str, Any]]) -> dict[str, Any]:
    """TRL's SFTTrainer through ``lamina_trainer`` on pre-tokenized rows (a word-level
    tokenizer built here: nothing downloaded), with SFTConfig's defaults but fp32."""
    import datasets
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from lamina.integrations.hf import lamina_trainer

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "</s>": VOCAB - 1}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
        pad_token="<pad>",
        eos_token="</s>",
    )
    rows = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in data]})
    config = SFTConfig(
        output_dir=str(tmp / "sft"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        use_cpu=True,
        seed=0,
        log_level="error",
        bf16=False,  # SFTConfig's default is bf16; the other runs are fp32
    )  # and its default activation checkpointing (each decoder layer recomputed) stays on
    trainer, losses = _train(
        lamina_trainer(SFTTrainer),
        model=_llama(),
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
        strategy="zero3",
        strategy_options={"min_unit_numel": 0},
    )
    from torch.distributed.tensor import DTensor

    return {
        "losses": losses,
        "class": type(trainer).__name__,
        "strategy": trainer.model.execution_plan.strategy,
        "sharded": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
    }


def _refusals(tmp: Path, data: list[dict[str, Any]]) -> dict[str, Any]:
    from accelerate import ParallelismConfig

    from lamina.integrations.hf import LaminaTrainer

    def trainer(**kwargs: Any) -> Any:
        args = kwargs.pop("args", None) or _args(tmp / "refused")
        return LaminaTrainer(model=_llama(), args=args, train_dataset=data, **kwargs)

    both = _args(tmp / "refused", parallelism_config=ParallelismConfig(dp_shard_size=2))
    return {
        "pp": _refused(lambda: trainer(parallelism=LaminaParallelism(pp=2))),
        "both": _refused(lambda: trainer(args=both, strategy="zero3")),
        "mesh": _refused(lambda: trainer(strategy="zero3", mesh={"fsdp": 2})),
    }


def _factory() -> dict[str, Any]:
    """``lamina_trainer`` on a Trainer subclass of the caller's, twice, and on a class that
    is not a Trainer (here, where transformers is imported already)."""
    from transformers import Trainer

    from lamina.integrations.hf import LaminaTrainer, LaminaTrainerMixin, lamina_trainer

    class MyTrainer(Trainer):
        pass

    made = lamina_trainer(MyTrainer)
    return {
        "same_class": made is lamina_trainer(MyTrainer),
        "subclass": issubclass(made, MyTrainer),
        "mixin_first": made.__mro__[1] is LaminaTrainerMixin,
        "name": made.__name__,
        "kept": lamina_trainer(LaminaTrainer) is LaminaTrainer,
        "refused": _refused(lambda: lamina_trainer(dict)),
    }


def _two_rank_job(tmp: str) -> dict[str, dict[str, Any]]:
    lamina.init()
    root, data = Path(tmp), _rows(STEPS * 2 * BATCH)
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "dp": lambda: _dp(root, data),
        "zero3": lambda: _zero3(root, data),
        "refusals": lambda: _refusals(root, data),
        "factory": _factory,
    }
    if find_spec("trl") is not None and find_spec("datasets") is not None:
        cases["sft"] = lambda: _sft(root, data)
    results = {name: _case(case) for name, case in cases.items()}
    lamina.shutdown()
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("hf_two")
    return run_ranks(
        _two_rank_job, 2, args=(str(root),), env={"LAMINA_BACKEND": "cpu"}, timeout=300
    )


def _results(job: list[dict[str, dict[str, Any]]], case: str) -> list[dict[str, Any]]:
    per_rank = [results[case] for results in job]
    for rank, result in enumerate(per_rank):
        assert result["error"] is None, f"{case} on rank {rank}:\n{result['error']}"
    return per_rank


def _close(got: list[float], want: list[float], tolerance: float = TOLERANCE) -> bool:
    return len(got) == len(want) == STEPS and all(
        abs(a - b) <= tolerance for a, b in zip(got, want, strict=True)
    )


def test_dp_trains_as_laminas_loop_and_as_trainers_own_ddp_accumulating_too(
    two_ranks: Any,
) -> None:
    for got in _results(two_ranks, "dp"):
        assert _close(got["losses"], got["loop"]), got
        assert _close(got["losses"], got["ddp"]), got
        assert _close(got["accumulated"], got["ddp_accumulated"]), got
        # the numbers agree; lamina ran: its model, its plan, no DDP around it
        assert got["unwrapped"] and got["distributed"] and got["strategy"] == "dp", got
        assert got["plain_wrapper"] == "DistributedDataParallel"


def test_zero3_trains_as_laminas_loop_with_every_parameter_sharded(two_ranks: Any) -> None:
    for got in _results(two_ranks, "zero3"):
        assert _close(got["losses"], got["loop"]), got
        assert got["sharded"] and got["strategy"] == "zero3", got


def test_zero3_resumed_from_a_checkpoint_continues_exactly(two_ranks: Any) -> None:
    for got in _results(two_ranks, "zero3"):
        # bitwise: the same shards, optimizer state, schedule and batches, the same ops
        assert got["resumed"] == got["losses"][RESUME_AT:], got
        # the whole weights as save_pretrained writes them, lamina's sharded state beside
        assert {"lamina", "model.safetensors", "trainer_state.json"} <= set(got["checkpoint"])
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(got["checkpoint"])


def test_zero3_resumed_from_whole_weights_only_starts_from_those_weights(two_ranks: Any) -> None:
    for got in _results(two_ranks, "zero3"):
        # model.safetensors loaded into the shards (no optimizer state: later steps differ)
        assert got["from_weights"][0] == got["losses"][RESUME_AT], got


def test_zero3_save_model_writes_a_whole_checkpoint_from_pretrained_loads(two_ranks: Any) -> None:
    saved = _results(two_ranks, "zero3")[0]["saved"]
    assert saved["missing"] == [], saved
    assert "model.safetensors" in saved["files"] and "config.json" in saved["files"]
    assert abs(saved["loss"] - saved["trained"]) <= 1e-6, saved


@pytest.mark.skipif(find_spec("trl") is None, reason="TRL is not installed")
def test_trl_sft_trainer_through_lamina_trainer_trains_as_lamina_trainer(two_ranks: Any) -> None:
    zero3 = _results(two_ranks, "zero3")
    for rank, got in enumerate(_results(two_ranks, "sft")):
        assert got["class"] == "LaminaSFTTrainer"
        assert got["strategy"] == "zero3" and got["sharded"], got
        # SFT's fused LM head computes the same next-token loss on the same rows
        assert _close(got["losses"], zero3[rank]["losses"]), (got, zero3[rank])


def test_a_trainer_refuses_pp_two_spellings_and_another_mesh_in_one_line(
    two_ranks: Any,
) -> None:
    for got in _results(two_ranks, "refusals"):
        for case in ("pp", "both", "mesh"):
            assert got[case] and "\n" not in got[case], (case, got)
        assert "model.step(inputs, targets, loss_fn)" in got["pp"], got
        assert "run the pipeline in lamina's own loop" in got["pp"], got
        assert "not both" in got["both"], got
        assert "already initialized with mesh {'dp': 2}" in got["mesh"], got


def test_lamina_trainer_extends_any_trainer_class_once(two_ranks: Any) -> None:
    got = _results(two_ranks, "factory")[0]
    assert got["same_class"] and got["subclass"] and got["mixin_first"] and got["kept"], got
    assert got["name"] == "LaminaMyTrainer", got
    assert "give a transformers.Trainer subclass" in got["refused"], got


# -- 4 ranks ------------------------------------------------------------------------------------
def _tp_zero3(tmp: Path, data: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    from lamina.integrations.hf import LaminaTrainer

    spelling = {"strategy": ["tp", "zero3"], "mesh": {"fsdp": 2, "tp": 2}}
    args = _args(tmp / "tp", save_strategy="steps", save_steps=RESUME_AT)
    trainer, losses = _train(
        LaminaTrainer, model=_llama(), args=args, train_dataset=data, **spelling
    )
    model = trainer.model
    _, resumed = _train(
        LaminaTrainer,
        resume=str(tmp / "tp" / f"checkpoint-{RESUME_AT}"),
        model=_llama(),
        args=args,
        train_dataset=data,
        **spelling,
    )
    x = torch.stack([data[i]["input_ids"] for i in range(BATCH)])
    return {
        "losses": losses,
        "resumed": resumed,
        "loop": _lamina_loop(data, ["tp", "zero3"], example_inputs=(x,)),
        "strategy": model.execution_plan.strategy,
        "q_proj": model.placement.of("model.layers.0.self_attn.q_proj.weight").describe(),
        "replica": tuple(model.data_replica),
        "tp_size": trainer.get_tp_size(),
        "saved": _loads_back(trainer, tmp / "tp-final", data),
    }


def _accelerate_config(tmp: Path, data: list[dict[str, Any]]) -> dict[str, Any]:
    from accelerate import ParallelismConfig

    from lamina.integrations.hf import LaminaTrainer

    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    args = _args(tmp / "accelerate", parallelism_config=config)
    trainer, losses = _train(LaminaTrainer, model=_llama(), args=args, train_dataset=data)
    mesh = trainer.lamina_runtime.mesh
    return {
        "losses": losses,
        "plan": trainer.lamina_plan,
        "mesh": dict(zip(mesh.axis_names, mesh.shape, strict=True)),
        "coordinates": mesh.coordinates(),
        "strategy": trainer.model.execution_plan.strategy,
        "replica": tuple(trainer.model.data_replica),
        "accelerate_config": trainer.accelerator.parallelism_config,
    }


def _four_rank_job(tmp: str) -> dict[str, dict[str, Any]]:
    runtime = lamina.init(mesh={"fsdp": 2, "tp": 2})  # lamina's own spelling
    root, data = Path(tmp), _rows(STEPS * 2 * BATCH)
    results = {
        "spelling": {"coordinates": runtime.mesh.coordinates(), "error": None},
        "tp_zero3": _case(lambda: _tp_zero3(root, data)),
        "accelerate": _case(lambda: _accelerate_config(root, data)),
    }
    lamina.shutdown()
    return results


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("hf_four")
    return run_ranks(
        _four_rank_job, 4, args=(str(root),), env={"LAMINA_BACKEND": "cpu"}, timeout=300
    )


def test_tp_by_zero3_trains_as_laminas_loop_with_the_layers_split(four_ranks: Any) -> None:
    for rank, got in enumerate(_results(four_ranks, "tp_zero3")):
        assert _close(got["losses"], got["loop"]), got
        assert got["strategy"] == "tp+zero3", got
        assert got["q_proj"] == "fsdp: Shard(0), tp: Split(0)", got
        # a tp group reads one data replica: ranks (0, 1) and (2, 3)
        assert got["replica"] == (rank // 2, 2) and got["tp_size"] == 2, got


def test_tp_by_zero3_resumes_exactly_and_saves_whole_weights(four_ranks: Any) -> None:
    per_rank = _results(four_ranks, "tp_zero3")
    for got in per_rank:
        assert got["resumed"] == got["losses"][RESUME_AT:], got
    saved = per_rank[0]["saved"]
    assert saved["missing"] == [] and abs(saved["loss"] - saved["trained"]) <= 1e-6, saved


def test_accelerate_parallelism_config_gives_laminas_own_mesh_and_losses(four_ranks: Any) -> None:
    spelled = _results(four_ranks, "tp_zero3")
    for rank, got in enumerate(_results(four_ranks, "accelerate")):
        assert got["plan"] == LaminaPlan({"fsdp": 2, "tp": 2}, ("tp", "zero3")), got
        # the mesh lamina.init(mesh={"fsdp": 2, "tp": 2}) built: the same axes, sizes and
        # this rank's coordinates on them
        assert got["mesh"] == {"fsdp": 2, "tp": 2}, got
        assert got["coordinates"] == four_ranks[rank]["spelling"]["coordinates"], got
        assert got["strategy"] == "tp+zero3" and got["replica"] == (rank // 2, 2), got
        assert got["accelerate_config"] is None  # Accelerate built no mesh of its own
        assert got["losses"] == spelled[rank]["losses"], (got, spelled[rank])


# -- the example --------------------------------------------------------------------------------
def test_example_trains_saves_and_resumes_from_its_checkpoint_exactly(tmp_path: Path) -> None:
    output = tmp_path / "run"
    common = ["--strategy", "zero3", "--max-steps", "6", "--save-steps", "3", "--batch-size", "4"]
    common += ["--seq-len", "32", "--corpus-mb", "0.2", "--output-dir", str(output)]
    env = {"LAMINA_BACKEND": "cpu"}
    first = run_example("hf_trainer_llama.py", *common, ranks=2, env=env, timeout=200)
    assert first.returncode == 0, first.stderr[-3000:]
    steps = dict(re.findall(r"step +(\d+)/6 \| loss ([\d.]+)", first.stdout))
    assert sorted(steps, key=int) == [str(s) for s in range(1, 7)], first.stdout
    assert float(steps["6"]) < float(steps["1"]), first.stdout
    assert f"saved to {output / 'final'}" in first.stdout
    again = run_example(
        "hf_trainer_llama.py",
        *common,
        "--resume",
        str(output / "checkpoint-3"),
        ranks=2,
        env=env,
        timeout=200,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = dict(re.findall(r"step +(\d+)/6 \| loss ([\d.]+)", again.stdout))
    assert resumed == {s: steps[s] for s in ("4", "5", "6")}, (first.stdout, again.stdout)

    from transformers import LlamaForCausalLM

    _, info = LlamaForCausalLM.from_pretrained(str(output / "final"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
