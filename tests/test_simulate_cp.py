"""The simulator's context-parallel step (``lamina.simulate.context``): the measured
compute plus the blocks cp adds, the pass-KV ring's transfers hidden behind the blocks
that arrive before them, and the all-gather and all-to-all as plain collectives."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from lamina.simulate import cluster_from_dict, predict
from lamina.strategies.cp.choose import Timed
from lamina.strategies.cp.layout import SequenceLayout, extra_blocks
from lamina.strategies.cp.plan_nodes import (
    AttentionSite,
    OutputSite,
    build_context_plan,
    compute_meta,
)

LAYOUT = SequenceLayout(1024, 2, 0)
SITE = AttentionSite(0, 1, 4, 4, 32, 32, "float32", True)
TIMED = Timed(block_forward_s=0.002, block_backward_s=0.005, local_step_s=0.1)


def _plan(algorithm: str) -> object:
    return build_context_plan(
        (SITE, dataclasses.replace(SITE, index=1)),
        (algorithm, algorithm),
        (OutputSite((1, 1024, 64), "float32"),),
        LAYOUT.local_length,
        nn.Linear(4, 4),
        (0, 1),
        "cp",
        2,
        "gloo",
        None,
        compute_meta(TIMED, LAYOUT, (SITE, SITE)),
        broadcast=True,
    )


def _cluster(bandwidth_gbps: float) -> object:
    return cluster_from_dict(
        {
            "hosts": 1,
            "devices_per_host": 2,
            "intra": {"bandwidth_gbps": bandwidth_gbps, "latency_us": 0},
            "mesh": {"cp": 2},
        },
        "cluster.json",
    )


def test_blocks_cp_adds_are_counted_from_the_layout() -> None:
    # cp=2, causal, head and tail chunks: rank 0 holds chunks 0 and 3 and sees 0..3;
    # among its own chunks it computes (0,0)/2, (3,0), (3,3)/2; cp adds (3,1) and (3,2)
    assert extra_blocks(LAYOUT, causal=True) == 2.0
    assert extra_blocks(SequenceLayout(1024, 2, 1), causal=True) == 2.0
    assert extra_blocks(LAYOUT, causal=False) == 4.0


@pytest.mark.parametrize("bandwidth", [0.001, 1000.0])
def test_the_ring_is_hidden_behind_attention_until_the_link_is_slower(bandwidth: float) -> None:
    prediction = predict(_plan("pass_kv"), _cluster(bandwidth))  # type: ignore[arg-type]
    context = prediction.context
    assert context is not None
    # the local step plus 2 added blocks per call, 2 calls, forward and backward each
    assert context.compute_s == pytest.approx(0.1 + 4 * (0.002 + 0.005))
    kv = 2 * 1 * 4 * 512 * 32 * 4  # keys and values of one rank, bytes
    step = kv / (bandwidth * 1e9)  # one ring step: each rank sends kv to its neighbour
    ring_blocks = 4 * 0.5  # a step's blocks: (2 own chunks)^2, half of them causal-skipped
    forward = max(0.0, step - ring_blocks * 0.002)
    backward = max(0.0, step - ring_blocks * 0.005)
    # per call: 1 forward step, 1 backward step of keys, 2 steps of their gradients
    assert context.ring_s == pytest.approx(2 * 4 * step)
    assert context.ring_exposed_s == pytest.approx(2 * (forward + backward + 2 * step))
    assert prediction.step_s == pytest.approx(
        context.compute_s + context.ring_exposed_s + prediction.total_s
    )
    if bandwidth > 1:
        assert context.ring_exposed_s == pytest.approx(2 * 2 * step)  # gradients only


def test_all_gather_and_all_to_all_are_collectives_on_the_cp_axis() -> None:
    for algorithm, ops in (
        ("all_gather", {"all_gather", "reduce_scatter"}),
        ("all_to_all", {"all_to_all"}),
    ):
        prediction = predict(_plan(algorithm), _cluster(0.01))  # type: ignore[arg-type]
        assert prediction.context is not None and prediction.context.ring_s == 0.0
        attention = {c.op for c in prediction.per_step if c.node.startswith("attention.")}
        assert attention == ops
        assert all(c.axis == "cp" for c in prediction.per_step)
