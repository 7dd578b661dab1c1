"""Blocks in any container (``lamina.graph.blocks``): the chain of blocks found in an
``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict`` (any keys, in call order) or a
custom container, for pp's cut, tp's block, ZeRO-3's units and auto; a model without one
is one line; and a GPT whose blocks sit in an ``nn.ModuleDict`` (torchtitan's form)
pipelined on pp=2 x dp=2 trains as one process does, under the model's own names."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import lamina
from lamina.errors import ConfigError
from lamina.graph.blocks import (
    block_containers,
    block_holding,
    container_blocks,
    unit_blocks,
)
from lamina.memory import ROOT_UNIT, group_units
from lamina.strategies.pp.chain import find_chain
from lamina.strategies.pp.stages import SkippedBlock, StageSpan, build_stages
from lamina.testing import run_ranks
from models_for_tests import GPT, Block, GPTConfig
from test_pipeline import _ids, _loss

pytestmark = [pytest.mark.multiprocess]

VOCAB, SEQ, WIDTH, LAYERS = 64, 16, 32, 4
STEPS = 3
CONFIG = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=WIDTH, n_layers=LAYERS, n_heads=4)


class _Embedded(nn.Module):
    """Tokens and positions in, logits out (head tied to the embedding), as the examples'
    GPT; subclasses hold the blocks and run them in :meth:`blocks_of`."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def blocks_of(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        out: torch.Tensor = self.head(self.ln_f(self.blocks_of(x)))
        return out


class DictGPT(_Embedded):
    """The blocks in an ``nn.ModuleDict`` under ``keys`` (torchtitan's ``"0".."N-1"`` by
    default), called in the order ``order`` gives (the keys' order by default)."""

    def __init__(self, keys: tuple[str, ...] | None = None, order: tuple[str, ...] = ()) -> None:
        super().__init__()
        keys = keys or tuple(str(i) for i in range(LAYERS))
        self.layers = nn.ModuleDict({k: Block(CONFIG) for k in keys})
        self.order = order or keys

    def blocks_of(self, x: torch.Tensor) -> torch.Tensor:
        for key in self.order:
            x = self.layers[key](x)
        return x


class Stack(nn.Module):
    """A custom container: three blocks as attributes, called one after another, and a
    norm of its own after them."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = Block(CONFIG), Block(CONFIG), Block(CONFIG)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.third(self.second(self.first(x))))
        return out


class StackGPT(_Embedded):
    def __init__(self) -> None:
        super().__init__()
        self.stack = Stack()

    def blocks_of(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.stack(x)
        return out


class Gated(nn.Module):
    """A small block: ``tanh(a x) * b x``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) * self.b(x)


class Branches(nn.Module):
    """Two blocks of one class, both fed the input (parallel branches): a container, but
    no chain."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = Gated(), Gated()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.left(x) + self.right(x)
        return out


def _chain_of(model: nn.Module) -> Any:
    x = _ids(0)[:2]
    return find_chain(model, lambda: model(x))


def test_a_module_list_and_a_sequential_hold_the_chain_as_before() -> None:
    gpt = GPT(CONFIG)
    chain = _chain_of(gpt)
    assert chain.container == "blocks" and chain.blocks == tuple(f"blocks.{i}" for i in range(4))
    assert chain.prefix == ("tok", "pos") and chain.suffix == ("ln_f", "head")
    # the MLP's nn.Sequential is a container too, inside a block: the outermost block wins
    assert block_containers(gpt)[0] == "blocks" and "blocks.0.mlp" in block_containers(gpt)
    assert block_holding(gpt, "blocks.2.mlp.0") == "blocks.2"
    assert block_holding(gpt, "tok") == "tok" and block_holding(gpt, "blocks") == "blocks"
    sequential = nn.Sequential(nn.Embedding(VOCAB, WIDTH), Block(CONFIG), Block(CONFIG))
    chain = _chain_of(sequential)
    assert chain.container == "" and chain.blocks == ("0", "1", "2")
    assert container_blocks(sequential, "") == ("0", "1", "2")


def test_a_module_dict_with_numbered_keys_keeps_its_names() -> None:
    model = DictGPT()
    chain = _chain_of(model)
    assert chain.container == "layers"
    assert chain.blocks == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert chain.prefix == ("tok", "pos") and chain.suffix == ("ln_f", "head")
    assert chain.entry_shapes == ((2, SEQ, WIDTH),) * 4
    assert block_holding(model, "layers.3.attn.qkv") == "layers.3"
    # auto measures the same chain: each block timed, its bytes counted
    from lamina.auto.measure import _chain_profile

    profile, why = _chain_profile(model, (_ids(0)[:2],), {}, 2, 1)
    assert why == "" and profile is not None and profile.chain.blocks == chain.blocks
    assert len(profile.costs.blocks) == LAYERS and len(set(profile.block_bytes)) == 1


def test_a_module_dict_with_named_keys_is_taken_in_call_order() -> None:
    model = DictGPT(keys=("blk_a", "blk_b", "blk_c"), order=("blk_c", "blk_a", "blk_b"))
    assert container_blocks(model, "layers") == ("layers.blk_a", "layers.blk_b", "layers.blk_c")
    chain = _chain_of(model)
    assert chain.blocks == ("layers.blk_c", "layers.blk_a", "layers.blk_b")
    assert block_holding(model, "layers.blk_b.mlp.2") == "layers.blk_b"


def test_a_custom_container_holds_its_blocks_and_its_norm_joins_the_suffix() -> None:
    model = StackGPT()
    # tok and pos (two nn.Embedding) are single layers, not blocks: the model is no container
    assert block_containers(model)[0] == "stack"
    chain = _chain_of(model)
    assert chain.container == "stack"
    assert chain.blocks == ("stack.first", "stack.second", "stack.third")
    assert chain.prefix == ("tok", "pos") and set(chain.suffix) == {"stack.norm", "ln_f", "head"}
    assert block_holding(model, "stack.second.attn.proj") == "stack.second"
    assert block_holding(model, "stack.norm") == "stack.norm"
    assert unit_blocks(model) == ("stack.first", "stack.second", "stack.third")
    # a stage holding only the first block: the others skipped under their own names, and
    # the container still one (what tensor parallelism inside a stage looks up)
    build_stages(model, chain, [StageSpan(0, 2, 0, 1)])
    assert isinstance(model.stack.second, SkippedBlock)
    assert container_blocks(model, "stack") == chain.blocks
    assert block_holding(model, "stack.first.attn.qkv") == "stack.first"
    assert not any(n.startswith("stack.second.") for n in model.state_dict())


def test_a_model_without_a_chain_of_blocks_is_one_line() -> None:
    """Parallel branches are a container but no chain; two linear layers in a row are no
    container at all (single layers are not blocks)."""
    branches = Branches()
    assert block_containers(branches) == ("",)
    x = torch.randn(2, SEQ, WIDTH)
    wanted = r"Branches has no nn\.ModuleList, nn\.Sequential, nn\.ModuleDict or other container"
    with pytest.raises(ConfigError, match=wanted) as err:
        find_chain(branches, lambda: branches(x))
    assert "\n" not in str(err.value)

    class TwoLinears(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.b(self.a(x))
            return out

    flat = TwoLinears()
    assert block_containers(flat) == () and unit_blocks(flat) == ()
    with pytest.raises(ConfigError, match=r"TwoLinears has no nn\.ModuleList") as err:
        find_chain(flat, lambda: flat(torch.randn(2, 4)))
    assert "\n" not in str(err.value)


def test_zero3_units_are_the_module_dicts_blocks() -> None:
    """ZeRO-3's layout (the strategy's own ``_layout``): one unit per ModuleDict block."""
    from lamina.strategies.zero3.options import Zero3Options
    from lamina.strategies.zero3.sharding import _layout

    model = DictGPT(keys=("blk_a", "blk_b", "blk_c"))
    blocks = ["layers.blk_a", "layers.blk_b", "layers.blk_c"]
    assert list(unit_blocks(model)) == blocks
    units = group_units(model, min_unit_numel=0, blocks=unit_blocks(model))
    assert [u for u, _ in units] == [ROOT_UNIT, *blocks]
    assert dict(units)["layers.blk_b"][0] == "layers.blk_b.ln1.weight"
    layout = _layout(model, 2, Zero3Options(min_unit_numel=0))
    assert [u.name for u in layout.units] == [ROOT_UNIT, *blocks]
    custom = _layout(StackGPT(), 2, Zero3Options(min_unit_numel=0))
    assert [u.name for u in custom.units][1:] == ["stack.first", "stack.second", "stack.third"]
    assert "stack.norm.weight" in custom.unit_of("stack.norm.weight").param_names


def _pp_dp_module_dict_job() -> dict[str, Any]:
    """3 SGD steps of :class:`DictGPT` pipelined on pp=2 x dp=2 against the same model
    trained in this process on every replica's batch."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    runtime = lamina.init(mesh={"pp": 2, "dp": 2})
    torch.manual_seed(0)
    reference = DictGPT()
    torch.manual_seed(0)
    ours = DictGPT()
    if runtime.rank:  # rank-seeded weights: the setup broadcast makes them rank 0's
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(torch.randn_like(p))
    replicas, replica = runtime.mesh.size("dp"), runtime.mesh.coordinates()["dp"]
    xs = [_ids(10 + k) for k in range(STEPS * replicas)]
    ys = [_ids(100 + k) for k in range(STEPS * replicas)]
    # "pp" on a pp x dp mesh: stages over pp, replicated over dp (as tests/test_pipeline.py)
    ours = lamina.distribute(ours, "pp", example_inputs=(xs[0],), timing_runs=1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    loss_errors = []
    for step in range(STEPS):
        batch = range(step * replicas, (step + 1) * replicas)
        parts = [_loss(reference(xs[k]), ys[k]) for k in batch]
        (sum(parts) / replicas).backward()
        k = step * replicas + replica
        loss = ours.step(xs[k], ys[k], _loss)  # type: ignore[operator]
        for opt in (opt_ref, opt_ours):
            opt.step()
            opt.zero_grad(set_to_none=True)
        want = parts[replica].item()
        loss_errors.append(abs(loss.item() - want) / abs(want))
    named = reference.state_dict()
    diff = max((named[n] - t).abs().max().item() for n, t in ours.state_dict().items())
    out = {
        "loss": max(loss_errors),
        "params": diff,
        "strategy": ours.execution_plan.strategy,  # type: ignore[union-attr]
        "names": sorted(n for n, _ in ours.named_parameters(remove_duplicate=False)),
        "dcp_keys": sorted(get_model_state_dict(ours)),
        "reference_names": sorted(n for n, _ in reference.named_parameters()),
        "reference_keys": sorted(named),
    }
    lamina.shutdown()
    return out


@pytest.fixture(scope="module")
def pp_dp_results() -> list[dict[str, Any]]:
    env = {"LAMINA_BACKEND": os.environ.get("LAMINA_BACKEND", "cpu")}
    return run_ranks(_pp_dp_module_dict_job, 4, env=env, timeout=300)


@pytest.mark.timeout(360)
def test_a_module_dict_model_pipelined_over_pp_by_dp_trains_as_one_process(
    pp_dp_results: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(pp_dp_results):
        assert result["loss"] <= 1e-6, (rank, result["loss"])
        assert result["params"] <= 1e-5, (rank, result["params"])
        assert result["strategy"] == "pp", result["strategy"]
    # the stages' parameters keep the model's own names: ranks 0 and 1 hold stage 0,
    # 2 and 3 stage 1 (pp is the first axis), together every parameter once
    names = [set(r["names"]) for r in pp_dp_results]
    assert names[0] == names[1] and names[2] == names[3]
    every = set(pp_dp_results[0]["reference_names"])
    assert all(n <= every | {"head.weight"} for n in names)
    assert {"tok.weight", "layers.0.attn.qkv.weight"} <= names[0]
    assert {"ln_f.weight", "layers.3.attn.qkv.weight"} <= names[2]
    assert "layers.1.attn.qkv.weight" in names[0] | names[2]
    blocks = [{n.split(".")[1] for n in s if n.startswith("layers.")} for s in names]
    assert not blocks[0] & blocks[2] and blocks[0] | blocks[2] == {"0", "1", "2", "3"}
    # what DCP saves: the model's own keys, every one on some rank
    keys = [set(r["dcp_keys"]) for r in pp_dp_results]
    assert set().union(*keys) == set(pp_dp_results[0]["reference_keys"])
