"""Graph capture: each path on a model that needs it, parameter bookkeeping, state safety."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from lamina.errors import ConfigError
from lamina.graph import CapturedGraph, CaptureError, capture
from models_for_tests import NeedsFx, NeedsHooks

pytestmark = pytest.mark.portable

METHODS = ("export", "fx", "hooks")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Gate(nn.Module):
    """Reads ``scale``; never reads ``spare``, although the module itself is called."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.spare = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Rich(nn.Module):
    """Tied embedding/head, a parameter used directly, BatchNorm, dropout, a gate with a
    spare parameter, an unused layer, a frozen layer, and keyword arguments."""

    def __init__(self, vocab: int = 10, width: int = 8, seq: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width))
        self.norm = nn.BatchNorm1d(seq)
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.5))
        self.gate = Gate(width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor | None = None, double: bool = False
    ) -> torch.Tensor:
        h = self.norm(self.emb(x) + self.pos)
        h = self.frozen(self.gate(self.body(h)))
        if scale is not None:
            h = h * scale
        if double:
            h = h + h
        return self.head(h)


RICH_USE_ORDER = (
    "emb.weight",
    "pos",
    "norm.weight",
    "norm.bias",
    "body.0.weight",
    "body.0.bias",
    "gate.scale",
)


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "objects": [id(t) for t in model.state_dict(keep_vars=True).values()],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["tensors"].keys() == b["tensors"].keys()
        and all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
        and a["objects"] == b["objects"]
        and a["training"] == b["training"]
        and torch.equal(a["rng"], b["rng"])
    )


@dataclass
class RichCapture:
    graph: CapturedGraph
    before: dict[str, Any]
    after: dict[str, Any]


@pytest.fixture(scope="module")
def mlp_graph() -> CapturedGraph:
    torch.manual_seed(0)
    return capture(MLP(), (torch.randn(3, 8),))


@pytest.fixture(scope="module", params=METHODS)
def rich(request: pytest.FixtureRequest) -> RichCapture:
    """The rich model captured by one path, with its full state before and after."""
    torch.manual_seed(0)
    model = Rich()
    model.body[1].eval()  # mixed training flags must survive too
    x = torch.randint(0, 10, (2, 4))
    kwargs = {"scale": torch.tensor(2.0), "double": True}
    before = _state(model)
    graph = capture(model, (x,), kwargs, methods=(request.param,))
    return RichCapture(graph, before, _state(model))


def test_plain_mlp_is_captured_by_export_in_layer_order(mlp_graph: CapturedGraph) -> None:
    g = mlp_graph
    assert g.method == "export" and g.fallbacks == ()
    layers = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias")
    assert g.param_names == layers
    assert g.first_use_order == layers
    assert g.grad_ready_order() == tuple(reversed(layers))
    assert g.unused == () and g.tied == ()
    assert g.param_shapes["fc2.weight"] == (16, 16)
    assert g.param_dtypes["fc3.bias"] == "torch.float32"
    linears = [n for n in g.nodes if n.target == "aten.linear.default"]
    assert [n.shapes for n in linears] == [((3, 16),), ((3, 16),), ((3, 4),)]
    assert all(n.dtypes == ("torch.float32",) and n.device == "cpu" for n in linears)


def test_data_dependent_branch_in_wrapped_function_falls_back_to_fx() -> None:
    torch.manual_seed(0)
    g = capture(NeedsFx(), (torch.randn(3, 4),))
    assert g.method == "fx"
    assert [f.method for f in g.fallbacks] == ["export"]
    assert "data-dependent" in g.fallbacks[0].reason.lower()
    assert g.first_use_order == ("a.weight", "a.bias", "b.weight", "b.bias")
    wrapped = [n for n in g.nodes if n.target.endswith("sign_flip")]
    assert len(wrapped) == 1 and wrapped[0].op == "call_function"
    assert wrapped[0].shapes == ((3, 4),)


def test_data_dependent_branch_in_forward_falls_back_to_hooks() -> None:
    torch.manual_seed(0)
    g = capture(NeedsHooks(), (torch.randn(3, 4),))
    assert g.method == "hooks"
    assert [f.method for f in g.fallbacks] == ["export", "fx"]
    assert "data-dependent" in g.fallbacks[0].reason.lower()
    assert g.fallbacks[1].reason.startswith("TraceError")
    assert all("\n" not in f.reason for f in g.fallbacks)
    assert [n.name for n in g.nodes] == ["(root)", "a", "a#1", "b"]
    assert g.nodes[-1].shapes == ((3, 2),) and g.nodes[-1].op == "module"
    assert g.first_use_order == ("a.weight", "a.bias", "b.weight", "b.bias")
    assert "hooks" in g.summary() and "export: " in g.summary() and "\n" not in g.summary()


def test_every_path_finds_the_same_use_order(rich: RichCapture) -> None:
    assert rich.graph.fallbacks == ()
    assert rich.graph.first_use_order == RICH_USE_ORDER


def test_tied_weights_have_one_canonical_name(rich: RichCapture) -> None:
    g = rich.graph
    assert g.tied == (("emb.weight", "head.weight"),)
    assert "head.weight" not in g.param_names and "emb.weight" in g.param_names


def test_unused_parameters_are_listed(rich: RichCapture) -> None:
    assert rich.graph.unused == ("gate.spare", "unused.weight", "unused.bias")


def test_frozen_parameters_are_not_trainable(rich: RichCapture) -> None:
    g = rich.graph
    frozen = {"frozen.weight", "frozen.bias"}
    assert not frozen & {*g.param_names, *g.first_use_order, *g.unused, *g.param_shapes}


def test_keyword_arguments_reach_the_graph(rich: RichCapture) -> None:
    g = rich.graph
    assert g.nodes[-1].shapes == ((2, 4, 10),)
    if g.method != "hooks":
        placeholders = [n.target for n in g.nodes if n.op == "placeholder"]
        assert placeholders[:2] == ["x", "scale"]
        assert sum(n.target in ("aten.mul.Tensor", "operator.mul") for n in g.nodes) >= 2


def test_capture_leaves_parameters_buffers_modes_and_rng_as_found(rich: RichCapture) -> None:
    assert _same_state(rich.before, rich.after)


def test_capture_really_ran_a_forward_that_moves_batchnorm_stats() -> None:
    """The state check above is meaningful: a plain forward does change this state."""
    torch.manual_seed(0)
    model = Rich()
    before = _state(model)
    with torch.no_grad():
        model(torch.randint(0, 10, (2, 4)))
    assert not _same_state(before, _state(model))


def test_methods_restrict_the_paths_tried() -> None:
    g = capture(MLP(), (torch.randn(3, 8),), methods=("fx",))
    assert g.method == "fx" and g.fallbacks == ()
    with pytest.raises(CaptureError) as info:
        capture(NeedsHooks(), (torch.randn(3, 4),), methods=("fx",))
    assert [f.method for f in info.value.fallbacks] == ["fx"]


class TakesExtras(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **extras: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * extras["gain"]


def test_fx_says_when_it_cannot_bind_keyword_arguments() -> None:
    g = capture(
        TakesExtras(), (torch.randn(2, 4),), {"gain": torch.ones(4)}, methods=("fx", "hooks")
    )
    assert g.method == "hooks"
    assert "**kwargs" in g.fallbacks[0].reason
    assert g.first_use_order == ("fc.weight", "fc.bias")


def test_all_paths_failing_raises_one_line_naming_each_reason() -> None:
    with pytest.raises(CaptureError) as info:
        capture(MLP(), (torch.randn(3, 5),))  # wrong input width: nothing can run it
    message = str(info.value)
    assert "\n" not in message
    assert all(f"{m}: " in message for m in METHODS)
    assert [f.method for f in info.value.fallbacks] == list(METHODS)
    assert all(f.reason for f in info.value.fallbacks)


@pytest.mark.parametrize(
    ("args", "methods"), [([torch.randn(3, 8)], ("fx",)), ((torch.randn(3, 8),), ("jit",))]
)
def test_malformed_request_is_a_config_error(args: Any, methods: Any) -> None:
    with pytest.raises(ConfigError):
        capture(MLP(), args, methods=methods)


def test_to_json_round_trips(rich: RichCapture) -> None:
    data = rich.graph.to_json()
    assert json.loads(json.dumps(data)) == data
    assert CapturedGraph.from_json(json.loads(json.dumps(data))) == rich.graph
