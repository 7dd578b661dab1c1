"""Expert parallelism's dropless dispatch (``lamina.strategies.ep``) and its plugin point.

On 4 gloo ranks, an MoE layer of 8 experts (2 a rank, the transformers 5 stacked
layout) with top-2 routing, against the whole layer in one process on the same tokens
(:func:`lamina.testing.dispatchers.check_dispatcher`): each rank's output, its tokens'
and router's gradients, and its experts' gradients (from every rank's tokens) equal;
every exchange announced in order, forward and backward; a rank with no token takes part
without a hang. The MoE layers of transformers' Mixtral and Qwen3-MoE are found with
their expert counts and top-k; a dense model is a one-line error. A plugin's dispatcher
is found by name through ``lamina_register_dispatchers`` and checked by the same kit,
which catches one that drops the router weights; a plugin reusing a name, or answering
something else, fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fake_distributions import install_fake_distribution
from lamina.errors import ConfigError
from lamina.plugins import get_registry
from lamina.strategies.ep import (
    AllToAllDispatcher,
    ExpertGroup,
    dispatchers,
    find_moe_layers,
    resolve_dispatcher,
)
from lamina.testing.dispatchers import check_dispatcher_on_ranks
from modern_models import mixtral, qwen3_moe

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.parametrize("counts", [(10, 7, 12, 9), (10, 7, 12, 0)], ids=["uneven", "a rank idle"])
def test_dropless_dispatch_equals_the_whole_layer_in_one_process(counts: tuple[int, ...]) -> None:
    results = check_dispatcher_on_ranks("all_to_all", 4, counts)
    for check in results:
        assert max(check.errors.values()) < 1e-5, check.errors
        assert check.issued == [
            ("moe.0.counts", "all_to_all", False),
            ("moe.0.tokens", "all_to_all", False),
            ("moe.0.results", "all_to_all", False),
            ("moe.0.results_grad", "all_to_all", True),
            ("moe.0.tokens_grad", "all_to_all", True),
        ], check.issued


def test_an_expert_count_ep_does_not_divide_is_one_line() -> None:
    with pytest.raises(ConfigError) as error:
        ExpertGroup(None, 3, 0, 8)
    assert "\n" not in str(error.value)
    assert "8 experts do not split over ep=3 ranks; choose an ep degree that divides 8" in str(
        error.value
    )


UNWEIGHTED_PLUGIN = """
import torch

from lamina.hookspecs import hookimpl
from lamina.strategies.ep.dispatch import AllToAllDispatcher


class Unweighted(AllToAllDispatcher):
    \"\"\"The built-in exchange with every router weight taken as 1: wrong on purpose.\"\"\"

    name = "unweighted"

    def dispatch(self, ep, hidden, top_k_index, top_k_weights, experts, layer=0, issuing=None):
        ones = torch.ones_like(top_k_weights)
        return super().dispatch(ep, hidden, top_k_index, ones, experts, layer)


@hookimpl
def lamina_register_dispatchers():
    return [Unweighted()]
"""

CLASHING_PLUGIN = """
from lamina.hookspecs import hookimpl
from lamina.strategies.ep.dispatch import AllToAllDispatcher


@hookimpl
def lamina_register_dispatchers():
    return [AllToAllDispatcher()]  # 'all_to_all' is built in
"""

NOT_A_DISPATCHER_PLUGIN = """
from lamina.hookspecs import hookimpl


@hookimpl
def lamina_register_dispatchers():
    return ["deep-ep"]
"""


@pytest.fixture
def dispatcher_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    install_fake_distribution(tmp_path, "lamina-unweighted", "lamina_unweighted", UNWEIGHTED_PLUGIN)
    install_fake_distribution(tmp_path, "lamina-ep-clash", "lamina_ep_clash", CLASHING_PLUGIN)
    install_fake_distribution(
        tmp_path, "lamina-not-a-dispatcher", "lamina_not_a_dispatcher", NOT_A_DISPATCHER_PLUGIN
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the spawned ranks find it too
    get_registry(reload=True)  # lamina_clean reloads it again afterwards
    return tmp_path


def test_plugin_dispatchers_are_found_by_name_and_checked_against_the_layer(
    dispatcher_site: Path,
) -> None:
    registry = get_registry()
    known = dispatchers(registry)
    assert next(iter(known)) == "all_to_all" and "unweighted" in known
    assert type(known["all_to_all"]) is AllToAllDispatcher
    clash = registry.records["lamina-ep-clash"]
    assert clash.status == "failed" and clash.stage == "hook lamina_register_dispatchers"
    assert "dispatcher name 'all_to_all' is already registered" in (clash.error or "")
    bad = registry.records["lamina-not-a-dispatcher"]
    assert bad.status == "failed" and "returned str, not a lamina Dispatcher" in (bad.error or "")
    with pytest.raises(ConfigError, match="token dispatcher 'deep-ep' is unknown; use one of "):
        resolve_dispatcher("deep-ep", registry)
    with pytest.raises(AssertionError) as wrong:
        check_dispatcher_on_ranks("unweighted", 2)
    message = str(wrong.value)
    assert "dispatcher 'unweighted' differs from the whole layer in one process: rank 0:" in message
    assert "output differs by" in message and "router gradient differs by" in message


# -- finding the MoE layers ----------------------------------------------------------------


def test_moe_layers_of_mixtral_and_qwen3_moe_are_found_with_their_top_k() -> None:
    tokens = torch.randint(0, 64, (2, 16))
    model = mixtral()
    found = find_moe_layers(model, lambda: model(tokens))
    assert [layer.describe() for layer in found] == [
        f"model.layers.{i}.mlp.experts: 8 experts (32 -> 48), top-2" for i in range(2)
    ]
    qwen = qwen3_moe()
    found = find_moe_layers(qwen, lambda: qwen(tokens))
    assert [(layer.name, layer.experts, layer.top_k) for layer in found] == [
        (f"model.layers.{i}.mlp.experts", 4, 2) for i in range(2)
    ]


def test_a_model_without_moe_layers_is_one_line() -> None:
    dense = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError) as error:
        find_moe_layers(dense, lambda: dense(torch.randn(2, 8)))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("strategy 'ep' found no Mixture-of-Experts layer in the model")


def _ranks_at_other_layers() -> str:
    import lamina

    lamina.init()
    import torch.distributed as dist

    rank = dist.get_rank()
    ep = ExpertGroup(None, 2, rank, 4)
    hidden = torch.randn(6, 8)
    index = torch.randint(0, 4, (6, 2))
    try:
        # rank 1 skipped a layer: it is at layer 1 while rank 0 is at layer 0
        AllToAllDispatcher().dispatch(ep, hidden, index, torch.rand(6, 2), lambda t, n: t, rank)
    except ConfigError as error:
        return str(error)
    finally:
        lamina.shutdown()
    return "no error"


def test_a_rank_at_another_moe_layer_is_named_in_one_line_not_a_hang() -> None:
    from lamina.testing import run_ranks

    said = run_ranks(_ranks_at_other_layers, 2, env={"LAMINA_BACKEND": "cpu"}, timeout=120)
    assert said[0] == (
        "expert parallelism: rank 1 of the ep group is at MoE layer 1 while rank 0 is at MoE "
        "layer 0; every rank of the ep group must run the same MoE layers in the same order "
        "(the same model, inputs of the same shape, no layer skipped on some ranks)"
    )
    assert said[1].startswith("expert parallelism: rank 0 of the ep group is at MoE layer 0 ")
