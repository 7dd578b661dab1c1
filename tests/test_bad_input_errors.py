"""Bad input to the API gets a one-line error that names the thing and the fix.

Each test triggers one error in one process (``lamina.init()`` without torchrun variables
is a world of one) and checks its text. Errors tested elsewhere are not repeated here.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

import lamina
from lamina import session
from lamina.cli.rank_runner import write_plan
from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan
from lamina.runtime.primitives import choose_primitive
from lamina.strategies import Placement
from lamina.strategies.dp.compiled import compile_backend_of
from lamina.trace import recorder as rec
from lamina.trace import watchdog


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _message(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    return text


# -- api.py, strategies/contract.py, strategies/registry.py ------------------------------------
@pytest.mark.parametrize("strategy", ["dp", "zero3", "hsdp"])
def test_an_option_the_strategy_does_not_take_is_named_with_the_valid_ones(strategy: str) -> None:
    lamina.init()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(_net(), strategy, bucket_cap_mbb=5)
    message = _message(excinfo)
    assert message.startswith(f"strategy {strategy!r} has no option 'bucket_cap_mbb'; ")
    assert "its options are verify, " in message


def test_zero3_refuses_the_bucket_options_of_dp() -> None:
    lamina.init()
    with pytest.raises(ConfigError, match="strategy 'zero3' has no option 'bucket_cap_mb'"):
        lamina.distribute(_net(), "zero3", bucket_cap_mb=5, example_inputs=(torch.ones(1, 8),))


def test_an_unknown_strategy_lists_the_known_ones() -> None:
    lamina.init()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(_net(), "fsdp")
    assert _message(excinfo).startswith(
        "unknown strategy 'fsdp'; choose one of dp, zero3, hsdp, tp, pp, cp, ep (plugins add more"
    )


def test_hsdp_on_a_flat_mesh_says_how_to_build_one() -> None:
    lamina.init()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(_net(), "hsdp")
    message = _message(excinfo)
    assert message.startswith("strategy 'hsdp' needs mesh axes ['inter', 'intra'] but the mesh ")
    assert "lamina.init(mesh='topology')" in message


@pytest.mark.parametrize(
    ("strategy", "placement", "shown"),
    [
        ("dp", Placement(replicate=("dp", "tp")), "unknown axis 'tp'"),
        ("zero3", Placement(), "axis 'dp' unplaced"),
        ("dp", Placement(shard=("dp",)), "strategy 'dp' does not shard"),
        ("zero3", Placement(replicate=("dp",)), "strategy 'zero3' shards over no mesh axis"),
    ],
)
def test_a_placement_that_does_not_fit_is_named(
    strategy: str, placement: Placement, shown: str
) -> None:
    lamina.init()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(_net(), strategy, placement=placement)
    assert shown in _message(excinfo)


def test_a_placement_naming_an_axis_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="names axis 'dp' both to shard and to replicate"):
        Placement(shard=("dp",), replicate=("dp",))
    with pytest.raises(ConfigError, match=r"Placement\.shard must be a tuple of mesh axis names"):
        Placement(shard="dp")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({"collectives": "fastest"}, "collectives='fastest' is not one of"),
        ({"param_dtype": torch.int8}, "param_dtype must be a floating torch dtype"),
        ({"disable_collectives": "all_gather"}, "disable_collectives='all_gather': give a tuple"),
        ({"min_unit_numel": -1}, "min_unit_numel must be an int >= 0"),
        ({"algorithm": "pipelined"}, "algorithm='pipelined' is not one of"),
    ],
)
def test_zero3_options_are_checked_before_anything_runs(
    options: dict[str, Any], shown: str
) -> None:
    lamina.init()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(_net(), "zero3", **options)
    assert _message(excinfo).startswith(shown)


def test_distribute_names_a_mesh_that_does_not_cover_the_job() -> None:
    """Only a runtime whose mesh and world size disagree reaches it (init builds them to
    agree), so the runtime is swapped for such a copy."""
    runtime = lamina.init()
    session._RUNTIME = dataclasses.replace(runtime, world_size=2)
    try:
        with pytest.raises(ConfigError) as excinfo:
            lamina.distribute(_net(), "dp")
    finally:
        session._RUNTIME = runtime
    message = _message(excinfo)
    assert message.startswith("mesh DeviceMesh(cpu: dp=1) holds 1 rank(s) but the job has 2;")
    assert "call lamina.init() with mesh='flat'" in message


# -- strategies/dp.py -------------------------------------------------------------------------
def test_data_parallel_without_init_says_to_call_init() -> None:
    runtime = lamina.init()
    dist.destroy_process_group()  # a runtime whose process group someone else destroyed
    assert not dist.is_initialized()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(_net(), "dp", runtime=runtime)
    assert _message(excinfo) == (
        "strategy 'dp' needs torch.distributed; call lamina.init() before distribute()"
    )


@pytest.mark.parametrize(
    ("options", "shown"),
    [({"bucket_cap_mb": 0}, "got 0 and None"), ({"first_bucket_mb": -2.0}, "got None and -2.0")],
)
def test_bucket_sizes_must_be_positive(options: dict[str, Any], shown: str) -> None:
    lamina.init()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(_net(), "dp", **options)
    assert _message(excinfo) == f"bucket_cap_mb and first_bucket_mb must be > 0, {shown}"


def test_a_model_distributed_twice_is_refused() -> None:
    # (no_sync() before the first forward is no error any more: tests/test_dp_in_place.py)
    lamina.init()
    model = lamina.distribute(_net(), "dp")
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(model, "dp")
    assert _message(excinfo) == (
        "this Sequential is already distributed with 'dp'; distribute the model once, "
        "with one strategy"
    )


# -- strategies/dp/compiled.py --------------------------------------------------------------------
@pytest.mark.parametrize("option", ["", 3])
def test_compile_option_must_be_a_bool_or_a_backend_name(option: Any) -> None:
    lamina.init()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(_net(), "dp", compile=option)
    assert _message(excinfo) == (
        f"compile={option!r}: pass False, True or a torch.compile backend name"
    )
    assert compile_backend_of(True) == "inductor" and compile_backend_of("eager") == "eager"


# -- strategies/zero3/sharding.py, module.py (ZeRO-3, and torch's state-dict APIs on its DTensors)
def _zero3() -> Any:
    lamina.init()
    return lamina.distribute(_net(), "zero3", min_unit_numel=1)


def test_distributing_a_sharded_model_again_says_to_do_it_once() -> None:
    model = _zero3()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(model, "zero3")
    assert _message(excinfo) == (
        "this Sequential is already distributed with 'zero3'; distribute the model once, "
        "with one strategy"
    )


def test_sharding_a_data_parallel_model_says_to_pick_one_strategy() -> None:
    lamina.init()
    model = lamina.distribute(_net(), "dp")
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(model, "zero3")
    assert _message(excinfo) == (
        "this Sequential is already distributed with 'dp'; distribute the model once, "
        "with one strategy"
    )


def test_zero3_without_init_says_to_call_init() -> None:
    runtime = lamina.init()
    lamina.shutdown()  # a runtime kept past shutdown: its process group is gone
    model = _net()
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(model, "zero3", runtime=runtime)
    assert _message(excinfo) == "this mesh was released by lamina.shutdown(); call lamina.init()"
    assert type(model) is nn.Sequential  # left as it was
    runtime = lamina.init()
    dist.destroy_process_group()  # a runtime whose process group someone else destroyed
    with pytest.raises(ConfigError) as excinfo:
        lamina.distribute(model, "zero3", runtime=runtime)
    assert _message(excinfo) == (
        "strategy 'zero3' needs torch.distributed; call lamina.init() before distribute()"
    )
    assert type(model) is nn.Sequential  # left as it was


def test_full_state_dict_of_another_model_names_the_unexpected_keys() -> None:
    model = _zero3()
    other = nn.Sequential(*_net(), nn.Linear(2, 2)).state_dict()  # a fourth layer, "3"
    with pytest.raises(RuntimeError) as excinfo:
        set_model_state_dict(model, other, options=StateDictOptions(full_state_dict=True))
    assert 'Unexpected key(s) in state_dict: "3.weight", "3.bias"' in str(excinfo.value)


def test_full_state_dict_with_a_parameter_of_another_shape_names_it() -> None:
    model = _zero3()
    other = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).state_dict()
    with pytest.raises(RuntimeError) as excinfo:
        set_model_state_dict(model, other, options=StateDictOptions(full_state_dict=True))
    message = str(excinfo.value)
    assert "size mismatch for 2.weight: copying a param with shape torch.Size([3, 8])" in message


def test_load_state_dict_without_a_parameter_names_it() -> None:
    model = _zero3()
    state = model.state_dict()
    del state["2.weight"]
    with pytest.raises(RuntimeError) as excinfo:
        model.load_state_dict(state, strict=True)
    assert 'Missing key(s) in state_dict: "2.weight"' in str(excinfo.value)


def test_load_state_dict_of_a_full_state_dict_loads_each_rows_and_names_a_bad_shape() -> None:
    """A full (plain) state dict loads through the module's own load_state_dict (each rank
    takes its rows); a plain value of the wrong shape is named by torch's size check, and
    ``assign=True``, which would replace the shard views, is one line."""
    model = _zero3()
    other = _net()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model.load_state_dict(other.state_dict(), strict=True)
    for name, value in other.state_dict().items():
        assert torch.equal(model.state_dict()[name].full_tensor(), value), name
    wrong = dict(other.state_dict(), **{"2.weight": torch.zeros(3, 8)})
    with pytest.raises(RuntimeError) as excinfo:
        model.load_state_dict(wrong, strict=True)
    assert "size mismatch for 2.weight" in str(excinfo.value)
    with pytest.raises(ConfigError) as config_error:
        model.load_state_dict(other.state_dict(), assign=True)
    assert _message(config_error).startswith(
        "load_state_dict(assign=True) would replace a zero3 model's sharded parameters"
    )


# -- session.py -------------------------------------------------------------------------------
def test_init_names_an_existing_group_of_another_size(monkeypatch: pytest.MonkeyPatch) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as excinfo:
        lamina.init()
    assert _message(excinfo) == (
        "an existing process group has world size 1 but WORLD_SIZE=2; "
        "destroy it or fix the environment"
    )
    assert dist.is_initialized()  # the caller's group is left alone


def test_init_names_a_runtime_that_placed_the_rank_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A runtime that assigns ranks itself (``init_method``) put this process at rank 0 of
    1 while the launcher said rank 1 of 2."""
    real = dist.init_process_group

    def placed_alone(backend: str, **_: Any) -> None:
        real(backend, store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]

    monkeypatch.setattr(dist, "init_process_group", placed_alone)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ConfigError) as excinfo:
        lamina.init()
    assert _message(excinfo) == (
        "the cpu runtime placed this process at rank 0 of 1 but RANK=1, WORLD_SIZE=2; launch "
        "so that they agree (torchrun --node-rank must follow the runtime's host order)"
    )
    assert not dist.is_initialized()  # the group it made is destroyed again


def test_init_names_a_mesh_it_does_not_understand() -> None:
    with pytest.raises(ConfigError) as excinfo:
        lamina.init(mesh="ring")  # type: ignore[arg-type]
    assert _message(excinfo) == (
        "mesh='ring' is not understood; use 'flat', 'topology', (shape, axis_names) or a "
        "dict such as {'dp': 2, 'tp': 2}"
    )
    assert not dist.is_initialized() and lamina.current() is None


# -- runtime/primitives.py --------------------------------------------------------------------
def test_a_collective_without_an_alternative_is_named() -> None:
    with pytest.raises(ConfigError) as excinfo:
        choose_primitive("broadcast", "gloo")
    assert _message(excinfo) == (
        "collective 'broadcast' has no declared alternative; "
        "use one of ('reduce_scatter', 'all_gather')"
    )


# -- cli/rank_runner.py -----------------------------------------------------------------------
def test_a_plan_folder_that_cannot_be_created_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folder = str(blocker / "plans")
    plan = ExecutionPlan(strategy="dp", world_size=1, backend="cpu", nodes=(), edges=())
    with pytest.raises(ConfigError) as excinfo:
        write_plan(plan, folder, 0)
    message = _message(excinfo)
    assert message.startswith(f"plan output folder {folder!r} cannot be created (")
    assert message.endswith("); pick a writable folder")


# -- trace/watchdog.py ------------------------------------------------------------------------
@pytest.mark.parametrize("timeout", [0, -1.5, math.inf, math.nan])
def test_watchdog_timeout_must_be_positive_and_finite(timeout: float) -> None:
    with pytest.raises(ConfigError) as excinfo:
        watchdog.Watchdog(rec.TraceRecorder(0, 1), timeout)
    assert _message(excinfo) == (
        f"watchdog timeout must be a positive number of seconds, got {timeout}"
    )
