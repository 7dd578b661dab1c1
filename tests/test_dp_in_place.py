"""``dp`` extends the model in place (issue 26): the model keeps its class, methods and
state-dict keys; planning waits for the first forward that records gradients, wherever
it happens (inside ``no_sync()`` included); activation checkpointing applied after
``distribute`` works; checkpoints of the earlier wrapper (names ``module.<p>``) load.

Every rank builds its model from its own seed, so only the setup broadcast makes the
ranks agree; each comparison with torch DDP runs 3 SGD steps with the same feature on
both. One module-scoped 2-rank job runs every check; the Hugging Face checks run where
transformers is installed (``lamina-core[examples]``).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.checkpoint import CheckpointManager
from lamina.cli.main import main
from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan
from lamina.testing import run_ranks
from models_for_tests import MLP, batch, build, differs_from_rank0, loss_of, tiny_llama

pytestmark = [pytest.mark.portable, pytest.mark.cross_release]

STEPS = 3
#: fp32 results that differ only in the order of rounding (see test_dp_engine.py).
TOLERANCE = 1e-6
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NEEDS_TRANSFORMERS = "the Hugging Face checks need transformers (lamina-core[examples])"


def _param_diff(ours: nn.Module, reference: nn.Module) -> float:
    return max(
        (a - b).abs().max().item()
        for a, b in zip(ours.parameters(), reference.parameters(), strict=True)
    )


class OwnModule(nn.Module):
    """A model with its own ``module`` (a submodule of that name) and ``plan`` attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 4)
        self.plan = "the model's own"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module(x)
        return out


# -- the model keeps its class, methods and keys ---------------------------------------------
def _identity() -> dict[str, Any]:
    model = build("gpt", seed=0)
    cls = type(model)
    keys = list(model.state_dict())
    params = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    ours = lamina.distribute(model, "dp")
    try:
        lamina.distribute(ours, "dp")
        twice = ""
    except ConfigError as exc:
        twice = str(exc)
    own = lamina.distribute(OwnModule(), "dp")
    own(torch.ones(2, 4)).sum().backward()
    return {
        "same_object": ours is model,
        "isinstance": isinstance(ours, cls),
        "class_name": type(ours).__name__ == cls.__name__,
        "keys": list(ours.state_dict()) == keys,
        "params": [n for n, _ in ours.named_parameters()] == params,
        "modules": [n for n, _ in ours.named_modules()] == modules,
        "alias": ours.module is ours,
        "twice": twice,
        "own_module": isinstance(own.module, nn.Linear),
        "own_plan": own.plan,
        "own_planned": own.execution_plan is not None,
    }


# -- planning never gets in the way --------------------------------------------------------
def _before_first_forward(rank: int) -> dict[str, Any]:
    """state_dict, load_state_dict, to, to_empty, train/eval and a forward without
    gradients (on rank 0 alone: a collective there would hang) before the first forward
    that records gradients; then a planned eval forward on rank 0 alone."""
    model = lamina.distribute(build("mlp", seed=rank), "dp")
    out: dict[str, Any] = {"summary": model.step_summary()}
    rank0 = build("mlp", seed=0).state_dict()
    keys = list(model.state_dict())
    model.to(torch.float64)
    model.to_empty(device="cpu")
    model.to(torch.float32)
    model.load_state_dict(rank0)
    model.eval()
    model.train()
    x, y = batch("mlp", 0, rank)
    if rank == 0:
        with torch.no_grad():
            model(x)
    out["unplanned_after_no_grad"] = model.execution_plan is None
    loss_of("mlp", model(x), y).backward()
    assert model.run_log is not None
    out["planned"] = model.execution_plan is not None
    out["keys_kept"] = list(model.state_dict()) == keys
    out["loaded"] = all(torch.equal(v, rank0[k]) for k, v in model.state_dict().items())
    steps = model.run_log.current.step
    if rank == 0:
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
        with torch.no_grad():
            model(x)
    out["steps_recorded"] = (steps, model.run_log.current.step)
    return out


def _no_sync_first(rank: int) -> dict[str, Any]:
    """DDP's and Accelerate's accumulation: the first micro-batch of every step under
    ``no_sync()`` (the very first forward too), then a synchronizing one."""
    initial = build("mlp", seed=rank)
    ours = lamina.distribute(copy.deepcopy(initial), "dp", bucket_cap_mb=0.004)
    ddp = DDP(copy.deepcopy(initial))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ddp)]
    sync_inside = []
    for step in range(STEPS):
        parts = [batch("mlp", 2 * step + k, rank, size=4) for k in range(2)]
        for model in (ours, ddp):
            (x, y), (x2, y2) = parts
            with model.no_sync():  # type: ignore[operator]
                loss_of("mlp", model(x), y).backward()
                if model is ours:
                    assert ours.reducer is not None
                    sync_inside.append(ours.reducer.sync_enabled)
            loss_of("mlp", model(x2), y2).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert ours.reducer is not None
    return {
        "started_apart": differs_from_rank0("mlp", initial),
        "diff": _param_diff(ours, ddp.module),
        "sync_inside": sync_inside,
        "sync_after": ours.reducer.sync_enabled,
    }


# -- activation checkpointing applied after distribute ----------------------------------------
def _checkpoint_wrapper(rank: int) -> dict[str, Any]:
    """torch's ``checkpoint_wrapper`` on every GPT block, applied after ``distribute``
    (before the first forward), against DDP of the same wrapped model."""
    from _gpt_model import Block

    initial = build("gpt", seed=rank)
    ours = lamina.distribute(copy.deepcopy(initial), "dp")
    reference = copy.deepcopy(initial)
    for model in (ours, reference):
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block)
        )
    ddp = DDP(reference)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ddp)]
    for step in range(STEPS):
        x, y = batch("gpt", step, rank)
        for model in (ours, ddp):
            loss_of("gpt", model(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    wrapped = sum("_checkpoint_wrapped_module" in n for n, _ in ours.named_parameters())
    return {"wrapped_params": wrapped, "diff": _param_diff(ours, ddp.module)}


# -- checkpoints of the earlier wrapper --------------------------------------------------------
class _EarlierWrapper(nn.Module):
    """What ``dp`` returned before it extended models in place, as far as a checkpoint
    sees it: the model as ``.module`` (names ``module.<p>``) and the plan (strategy dp)."""

    def __init__(self, model: nn.Module, plan: ExecutionPlan | None) -> None:
        super().__init__()
        self.module = model
        self.execution_plan = plan


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch("mlp", step, rank)
    loss_of("mlp", model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _resumes(root: Path, saved: nn.Module, saved_opt: torch.optim.Optimizer, rank: int) -> bool:
    """A fresh dp model resumed from ``root`` holds ``saved``'s state and trains on like it."""
    fresh = lamina.distribute(build("mlp", seed=7 + rank), "dp")
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    step = CheckpointManager(root).load_latest(fresh, opt)
    same = step == 1 and _param_diff(fresh, saved) == 0.0
    for model, optimizer in ((fresh, opt), (saved, saved_opt)):
        _train_step(model, optimizer, 5, rank)
    return same and _param_diff(fresh, saved) == 0.0  # the optimizer state came back too


def _checkpoints(rank: int, base: Path) -> dict[str, Any]:
    model = lamina.distribute(build("mlp", seed=rank), "dp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0, rank)
    snapshot = copy.deepcopy([p.detach() for p in model.parameters()])
    opt_snapshot = copy.deepcopy(opt.state_dict())
    earlier = _EarlierWrapper(model, model.execution_plan)
    CheckpointManager(base / "earlier").save(1, earlier, opt, extra={"pos": 1})
    CheckpointManager(base / "new").save(1, model, opt, extra={"pos": 1})
    out: dict[str, Any] = {}
    for layout in ("earlier", "new"):
        out[layout] = _resumes(base / layout, model, opt, rank)
        with torch.no_grad():  # back to the saved state for the next layout
            for p, saved in zip(model.parameters(), snapshot, strict=True):
                p.copy_(saved)
        opt.load_state_dict(copy.deepcopy(opt_snapshot))
    other = lamina.distribute(MLP(width=16), "dp")
    try:
        CheckpointManager(base / "earlier").load_latest(
            other, torch.optim.AdamW(other.parameters())
        )
        out["refused"] = ""
    except ConfigError as exc:
        out["refused"] = str(exc)
    return out


# -- Hugging Face: the model's own methods -----------------------------------------------------
def _llama(seed: int) -> nn.Module:
    return tiny_llama(seed)


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def _generate(model: Any, prompt: torch.Tensor) -> list[list[int]]:
    model.eval()
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.train()
    result: list[list[int]] = out.tolist()
    return result


def _hugging_face(rank: int, base: Path) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    initial = _llama(seed=rank)
    ours = lamina.distribute(copy.deepcopy(initial), "dp")
    prompt = _tokens(99, 0)
    out: dict[str, Any] = {"isinstance": isinstance(ours, LlamaForCausalLM)}
    if rank == 0:  # before the first forward, on one rank: unplanned, no collective
        plain = copy.deepcopy(initial)
        out["generate_first"] = _generate(ours, prompt) == _generate(plain, prompt)
        out["unplanned_after_generate"] = ours.execution_plan is None
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    ours.gradient_checkpointing_enable(**kwargs)  # type: ignore[operator]
    reference = copy.deepcopy(initial)
    reference.gradient_checkpointing_enable(**kwargs)  # type: ignore[operator]
    ddp = DDP(reference)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ddp)]
    for step in range(STEPS):
        x = _tokens(step, rank)
        for model in (ours, ddp):
            model(input_ids=x, labels=x).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    layers: Any = ours.model.layers
    out["checkpointing"] = all(layer.gradient_checkpointing for layer in layers)
    out["diff"] = _param_diff(ours, ddp.module)
    if rank == 0:  # planned now; still on one rank alone
        steps = ours.run_log.current.step  # type: ignore[union-attr]
        plain = _llama(seed=0)
        plain.load_state_dict(ours.state_dict())
        out["generate"] = _generate(ours, prompt) == _generate(plain, prompt)
        out["generate_steps"] = (steps, ours.run_log.current.step)  # type: ignore[union-attr]
        ours.module.save_pretrained(base / "llama")  # type: ignore[operator]
        loaded = LlamaForCausalLM.from_pretrained(base / "llama")
        out["saved"] = _param_diff(loaded, ours) == 0.0
        out["architectures"] = loaded.config.architectures
    return out


def _job(base: str) -> dict[str, Any]:
    runtime = lamina.init()
    rank = runtime.rank
    out = {
        "identity": _identity(),
        "before_first_forward": _before_first_forward(rank),
        "no_sync_first": _no_sync_first(rank),
        "checkpoint_wrapper": _checkpoint_wrapper(rank),
        "checkpoints": _checkpoints(rank, Path(base)),
    }
    if HAS_TRANSFORMERS:
        out["hf"] = _hugging_face(rank, Path(base))
    return out


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp_in_place")


@pytest.fixture(scope="module")
def results(saved_base: Path) -> list[dict[str, Any]]:
    return run_ranks(_job, 2, args=(str(saved_base),), timeout=400)


# -- tests -----------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_the_model_keeps_its_class_keys_and_attributes(results: list[dict[str, Any]]) -> None:
    for result in (r["identity"] for r in results):
        assert result == {
            "same_object": True,
            "isinstance": True,
            "class_name": True,
            "keys": True,
            "params": True,
            "modules": True,
            "alias": True,
            "twice": (
                "this GPT is already distributed with 'dp'; distribute the model once, "
                "with one strategy"
            ),
            "own_module": True,  # the model's own `module` wins over the alias
            "own_plan": "the model's own",
            "own_planned": True,
        }


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_nothing_before_the_first_forward_with_gradients_plans_or_communicates(
    results: list[dict[str, Any]],
) -> None:
    for result in (r["before_first_forward"] for r in results):
        assert result["summary"].startswith("not planned yet"), result
        assert result["unplanned_after_no_grad"], result
        assert result["planned"] and result["keys_kept"], result
        assert result["loaded"], result  # rank 0's loaded state, broadcast at planning
    before, after = results[0]["before_first_forward"]["steps_recorded"]
    assert before == after == 1  # two forwards without gradients: no step recorded


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_accumulation_opening_with_no_sync_equals_ddp(results: list[dict[str, Any]]) -> None:
    assert results[1]["no_sync_first"]["started_apart"]
    for result in (r["no_sync_first"] for r in results):
        assert result["diff"] <= TOLERANCE, result
        assert result["sync_inside"] == [False] * STEPS and result["sync_after"], result


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_checkpoint_wrapper_applied_after_distribute_equals_ddp(
    results: list[dict[str, Any]],
) -> None:
    for result in (r["checkpoint_wrapper"] for r in results):
        assert result["wrapped_params"] > 0, result
        assert result["diff"] <= TOLERANCE, result


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_checkpoints_of_the_earlier_wrapper_and_the_new_keys_load(
    results: list[dict[str, Any]],
) -> None:
    for result in (r["checkpoints"] for r in results):
        assert result["earlier"] and result["new"], result
        assert result["refused"].startswith("checkpoint "), result
        # the saved names mapped to the model's: the first difference is a real one
        assert (
            "tensor 'layers.0.bias' is [32] float32 there and [16] float32 here"
            in (result["refused"])
        )
        assert "point the manager at this model's checkpoints" in result["refused"]
        assert "\n" not in result["refused"]


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_checkpoint_commands_read_both_layouts(
    results: list[dict[str, Any]], saved_base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert results  # the job saved both layouts
    earlier, new = saved_base / "earlier", saved_base / "new"
    assert main(["checkpoint", "ls", str(earlier)]) == 0
    assert " dp " in capsys.readouterr().out
    # the same state under both layouts: every tensor and value equal, names mapped
    assert main(["checkpoint", "diff", str(earlier), str(new)]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.weight" in out and "optim.state.layers.0.weight.exp_avg" in out
    assert out.splitlines()[-1].endswith("identical"), out
    pytest.importorskip("safetensors", reason="export writes safetensors")
    from safetensors.torch import load_file

    exported = {}
    for layout in (earlier, new):
        target = saved_base / f"{layout.name}.safetensors"
        assert main(["checkpoint", "export", str(layout), str(target)]) == 0
        exported[layout.name] = load_file(str(target))
    assert sorted(exported["earlier"]) == sorted(MLP().state_dict())
    for name, tensor in exported["new"].items():
        assert torch.equal(tensor, exported["earlier"][name]), name


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_hugging_face_methods_work_under_dp(results: list[dict[str, Any]]) -> None:
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    for result in (r["hf"] for r in results):
        assert result["isinstance"] and result["checkpointing"], result
        # gradient_checkpointing_enable() called after distribute, against DDP with it
        assert result["diff"] <= TOLERANCE, result
    first = results[0]["hf"]
    assert first["generate_first"] and first["unplanned_after_generate"], first
    assert first["generate"] and first["generate_steps"][0] == first["generate_steps"][1], first
    assert first["saved"] and first["architectures"] == ["LlamaForCausalLM"], first
