"""What a strategy says it can do, asked by name, never probed: ``lamina.compile_step``
asks the strategy that distributed the model for its compiled step (``dp`` and
``zero3`` build one, ``pp`` compiles its stages' blocks; ``tp`` alone and compositions
whose collectives are not captured refuse in one line saying what to run instead), and
``"auto"`` is a chooser whose choice ``lamina.distribute`` applies as strategies given
by hand (``lamina plan --auto`` asks for it without an environment
variable). One process, tiny models: each test takes about a second."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import lamina
from lamina.api import AutoRequest, request_auto
from lamina.auto.choose import distribute_candidate
from lamina.errors import ConfigError
from lamina.strategies.dp.compiled_step import DataParallelCompiledStep
from lamina.strategies.pp.compiled import PipelineCompiledStep
from lamina.strategies.zero3.compiled_step import ShardedCompiledStep
from models_for_tests import MLP, tiny_gpt

pytestmark = pytest.mark.portable

IDS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def job() -> Iterator[None]:
    yield
    lamina.shutdown()


def _refusal(model: torch.nn.Module) -> str:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as caught:
        lamina.compile_step(model, optimizer, F.cross_entropy)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_a_tensor_parallel_model_is_refused_in_one_line(job: None) -> None:
    lamina.init(mesh={"tp": 1})
    message = _refusal(lamina.distribute(tiny_gpt(), "tp", example_inputs=(IDS,)))
    assert message.startswith("compile_step does not take a model distributed with 'tp'")
    assert "loss.backward(); optimizer.step()" in message
    # tp's compiled step is the sharder's: composed with zero3 or hsdp
    assert "compose a split such as 'tp' with 'zero3' or 'hsdp'" in message, message


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_a_pipelined_model_compiles_its_stages_blocks(job: None) -> None:
    lamina.init(mesh={"pp": 1})
    model = lamina.distribute(tiny_gpt(), "pp", example_inputs=(IDS,), timing_runs=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = lamina.compile_step(model, optimizer, _lm_loss, backend="aot_eager")
    assert isinstance(step, PipelineCompiledStep)
    losses = [float(step(IDS, IDS.roll(-1, 1))) for _ in range(2)]
    assert step.eager_reason == "", step.eager_reason
    # blocks of one class share their graph (torch 2.9's guards compile one per block)
    assert 1 <= step.backend.graphs <= len(step.gates) == 2
    assert losses[1] < losses[0], losses


def test_a_pipeline_composed_with_tp_is_refused_naming_the_composition(job: None) -> None:
    lamina.init(mesh={"pp": 1, "tp": 1})
    model = lamina.distribute(tiny_gpt(), ["pp", "tp"], example_inputs=(IDS,), timing_runs=1)
    message = _refusal(model)
    assert "pipelined model composed with 'tp'" in message, message
    assert "model.step(inputs, targets, loss_fn)" in message


def test_a_dp_model_still_compiles_and_steps(job: None) -> None:
    lamina.init()
    torch.manual_seed(0)
    model = lamina.distribute(MLP(), "dp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = lamina.compile_step(model, optimizer, F.mse_loss, backend="aot_eager")
    assert isinstance(step, DataParallelCompiledStep)
    loss = step(torch.randn(8, 32), torch.randn(8, 32))
    assert torch.isfinite(loss)
    assert step.eager_reason == "", step.eager_reason


def test_zero3_records_the_models_own_class_for_its_compiled_step(job: None) -> None:
    lamina.init()
    model = lamina.distribute(MLP(), "zero3")
    step = lamina.compile_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    assert isinstance(step, ShardedCompiledStep)
    assert step.model_class is MLP and type(model) is not MLP


def test_plan_auto_request_chooses_without_an_environment_variable(job: None) -> None:
    lamina.init()
    request_auto(AutoRequest())  # what lamina plan --auto's rank runner asks
    try:  # the script names zero3: its own options are dropped, auto's kept
        model = lamina.distribute(
            MLP(), "zero3", example_inputs=(torch.randn(8, 32),), timing_runs=1, min_unit_numel=1
        )
    finally:
        request_auto(None)
    choice = model.lamina_auto  # type: ignore[union-attr]
    assert choice.distribution.strategies == ("dp",)  # the only candidate on one rank
    assert model.lamina_distributed_with == "dp"
    meta = dict(model.execution_plan.meta)  # type: ignore[union-attr]
    assert meta["auto"].startswith("dp (predicted ")  # the plan records the choice
    again = lamina.distribute(MLP(), "zero3")  # the request cancelled: as named
    assert again.lamina_distributed_with == "zero3" and "lamina_auto" not in again.__dict__
    by_hand = distribute_candidate(
        lamina.distribute, MLP(), choice.candidate, (torch.randn(8, 32),)
    )
    assert by_hand.lamina_distributed_with == "dp" and "lamina_auto" not in by_hand.__dict__
