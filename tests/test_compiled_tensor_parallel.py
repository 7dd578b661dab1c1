"""``lamina.compile_step`` on tensor parallelism composed with ``zero3`` and ``hsdp``: one
graph per rank holding the units' gathers, the forward with tp's activation collectives
(sequence parallelism's gathers and slices included), the backward with their adjoints,
the whole parameters' gradient sums over the tp group, the reduce-scatters, the
gradient norm over the shards and the tp group, the clipping and the update; against
lamina's eager step clipping with ``model.clip_grad_norm_``, from rank-seeded weights.

The run logs are compared too: each replay records in tp's run log the nodes the eager
step issues, and the compiled step's own nodes (the norm's all-reduces) in the sharder's.
Compiled with ``aot_eager`` (the capture and AOT autograd, not Inductor's C++ code).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import lamina
from lamina.testing import run_ranks
from models_for_tests import tiny_gpt, tiny_llama

pytestmark = [pytest.mark.portable, pytest.mark.multiprocess]

VOCAB, SEQ, ROWS, STEPS = 64, 16, 2, 4
TOLERANCE = 1e-6
#: Below every step's gradient norm here (0.9-1.6 at the first step): every step clips.
MAX_NORM = 0.05


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective: the state dict's DTensors are gathered)."""
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for n, t in model.state_dict().items()
    }


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _against_eager(
    strategy: list[str], mesh: dict[str, int], name: str, optimizer: str
) -> dict[str, Any]:
    """:data:`STEPS` compiled steps of ``name`` under ``strategy`` against its eager step,
    both clipping at :data:`MAX_NORM`."""
    runtime = lamina.init(mesh=mesh)
    torch.manual_seed(runtime.rank)  # rank-seeded: the setup broadcast makes them one
    initial = tiny_gpt() if name == "gpt" else tiny_llama(runtime.rank)
    eager = lamina.distribute(copy.deepcopy(initial), strategy, example_inputs=(_ids(0),))
    compiled = lamina.distribute(copy.deepcopy(initial), strategy, example_inputs=(_ids(0),))
    opt_eager, opt_compiled = _optimizer(optimizer, eager), _optimizer(optimizer, compiled)
    step = lamina.compile_step(
        compiled, opt_compiled, _loss, backend="aot_eager", max_norm=MAX_NORM
    )
    replica = compiled.data_replica  # type: ignore[union-attr]
    worst_loss = worst_norm = 0.0
    norms, tp_issued = [], []
    for k in range(STEPS):
        x, y = _ids(100 * k + replica.index), _ids(100 * k + replica.index + 50)
        loss = step(x, y)
        opt_eager.zero_grad(set_to_none=True)
        reference = _loss(eager(x), y)
        reference.backward()  # type: ignore[no-untyped-call]
        norm = float(eager.clip_grad_norm_(MAX_NORM))  # type: ignore[operator]
        opt_eager.step()
        assert step.last_grad_norm is not None
        norms.append(norm)
        worst_loss = max(worst_loss, abs(float(loss) - float(reference)))
        worst_norm = max(worst_norm, abs(float(step.last_grad_norm) - norm) / norm)
        eager_log, compiled_log = eager.lamina_tp.run_log, compiled.lamina_tp.run_log  # type: ignore[union-attr]
        tp_issued.append((dict(eager_log.current.issued), dict(compiled_log.current.issued)))
    ours, theirs = _whole(compiled), _whole(eager)
    sharder_log = compiled.run_log.last  # type: ignore[union-attr]
    plan = compiled.execution_plan  # type: ignore[union-attr]
    return {
        "loss": worst_loss,
        "param": max((ours[n] - theirs[n]).abs().max().item() for n in ours),
        "norm": worst_norm,
        "norms": norms,
        "eager_reason": step.eager_reason,
        "graphs": [[c.line() for c in graph] for graph in step.checked.graphs],
        "tp_issued": tp_issued,
        "sharder_issued": dict(sharder_log.issued) if sharder_log else {},
        "modes": sorted({n.detail.mode for n in plan.nodes if hasattr(n.detail, "mode")}),
        "norm_nodes": sorted(n.id for n in plan.nodes if n.id.startswith("grad_norm.")),
    }


def _check(
    results: list[dict[str, Any]],
    sequence_parallel: bool,
    norm_nodes: tuple[str, ...] = ("grad_norm.all_reduce", "grad_norm.tp"),
) -> None:
    for rank, result in enumerate(results):
        assert result["eager_reason"] == "", (rank, result["eager_reason"])
        assert result["modes"] == ["compiled_step:aot_eager"], result["modes"]
        assert min(result["norms"]) > MAX_NORM, result["norms"]  # every step clipped
        assert result["loss"] <= TOLERANCE and result["param"] <= TOLERANCE, (rank, result)
        assert result["norm"] <= TOLERANCE, (rank, result["norm"])
        assert len(result["graphs"]) == 1  # captured once, replayed
        # each replay records in tp's run log what the eager step issues, node by node
        for eager_issued, compiled_issued in result["tp_issued"][1:]:
            assert compiled_issued == eager_issued and compiled_issued, result["tp_issued"]
        assert result["norm_nodes"] == list(norm_nodes), result["norm_nodes"]
        assert result["sharder_issued"].get("grad_norm.tp") == 1, result["sharder_issued"]
        assert result["graphs"] == results[0]["graphs"]  # the same collectives everywhere
    lines = results[0]["graphs"][0]
    # tp's activation collectives are in the graph: the head's input gradient summed
    # (all-reduce over the 2 tp ranks), the sequence's gathers (a broadcast per rank)
    assert any(line.startswith("all_reduce") and "over 2 ranks" in line for line in lines)
    if sequence_parallel:
        assert sum(line.startswith("broadcast") for line in lines) >= 4, lines


@pytest.mark.timeout(400)
def test_tp_zero3_and_tp_hsdp_compiled_steps_equal_their_eager_steps_on_four_ranks() -> None:
    """The GPT with sequence parallelism under tp x zero3 (SGD), and a Hugging Face
    Llama with grouped-query attention under tp x hsdp (AdamW)."""
    zero3 = run_ranks(
        _against_eager,
        4,
        args=(["tp", "zero3"], {"fsdp": 2, "tp": 2}, "gpt", "sgd"),
        timeout=380,
    )
    _check(zero3, sequence_parallel=True)
    hsdp = run_ranks(
        _against_eager,
        4,
        args=(["tp", "hsdp"], {"dp": 2, "fsdp": 1, "tp": 2}, "llama", "adamw"),
        timeout=380,
    )
    # one shard per replica: the norm is summed over tp alone (the replicas hold the same)
    _check(hsdp, sequence_parallel=False, norm_nodes=("grad_norm.tp",))


@pytest.mark.timeout(300)
def test_tp_zero3_compiled_step_equals_its_eager_step_on_two_ranks() -> None:
    """tp over both ranks, zero3 over a shard group of one: only tp's collectives and
    the norm's."""
    _check(
        run_ranks(
            _against_eager,
            2,
            args=(["tp", "zero3"], {"fsdp": 1, "tp": 2}, "llama", "sgd"),
            timeout=280,
        ),
        sequence_parallel=False,
        norm_nodes=("grad_norm.tp",),  # one shard: the norm is summed over tp alone
    )
