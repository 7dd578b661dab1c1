"""Bucket planning: order, dtype homogeneity, caps, alignment, exclusions, rendering."""

from __future__ import annotations

import json

import pytest
import torch

from lamina.comm.buckets import (
    GLOO_ALPHA_S,
    GLOO_BETA_S_PER_BYTE,
    LATENCY_FRACTION,
    MIB,
    BucketPlan,
    ParamSpec,
    auto_bucket_cap,
    latency_floor_bytes,
    plan_buckets,
    ring_all_reduce_cost,
)
from lamina.errors import ConfigError


def _specs(*items: tuple[str, tuple[int, ...], torch.dtype]) -> list[ParamSpec]:
    return [ParamSpec(name, shape, dtype) for name, shape, dtype in items]


F32, BF16 = torch.float32, torch.bfloat16


def test_buckets_follow_ready_order_with_a_small_first_bucket() -> None:
    params = _specs(*[(f"w{i}", (256, 256), F32) for i in range(6)])  # 256 KiB each
    plan = plan_buckets(
        params, [f"w{i}" for i in reversed(range(6))], cap_bytes=MIB, first_bucket_bytes=300_000
    )
    assert [b.param_names for b in plan.buckets] == [("w5",), ("w4", "w3", "w2", "w1"), ("w0",)]
    assert all(b.nbytes <= MIB for b in plan.buckets)


def test_dtype_change_closes_a_bucket() -> None:
    params = _specs(("a", (10,), F32), ("b", (10,), BF16), ("c", (10,), F32))
    plan = plan_buckets(params, ["a", "b", "c"])
    assert [(b.dtype, b.param_names) for b in plan.buckets] == [
        ("float32", ("a",)),
        ("bfloat16", ("b",)),
        ("float32", ("c",)),
    ]


def test_slots_and_buckets_are_aligned() -> None:
    params = _specs(("a", (3,), F32), ("b", (5, 7), F32), ("c", (1,), F32))
    plan = plan_buckets(params, ["a", "b", "c"], alignment_bytes=512)
    (bucket,) = plan.buckets
    assert [s.offset for s in bucket.slots] == [0, 128, 256]
    assert bucket.numel % 128 == 0 and bucket.numel >= 257


def test_parameter_larger_than_cap_gets_its_own_bucket() -> None:
    params = _specs(("small", (4,), F32), ("huge", (1024, 1024), F32), ("tail", (4,), F32))
    plan = plan_buckets(
        params,
        ["small", "huge", "tail"],
        cap_bytes=MIB // 2,
        first_bucket_bytes=MIB // 2,
        min_bucket_bytes=0,  # no latency floor: the small one is not merged into "huge"
    )
    assert [b.param_names for b in plan.buckets] == [("small",), ("huge",), ("tail",)]
    merged = plan_buckets(params, ["small", "huge", "tail"], cap_bytes=MIB // 2)
    assert [b.param_names for b in merged.buckets] == [("small", "huge"), ("tail",)]


def test_unused_parameters_are_excluded_or_rejected_in_strict_mode() -> None:
    params = _specs(("a", (4,), F32), ("ghost", (4,), F32))
    plan = plan_buckets(params, ["a"], unused=["ghost"])
    assert plan.excluded == ("ghost",) and plan.buckets[0].param_names == ("a",)
    with pytest.raises(ConfigError, match=r"strict mode: parameters \['ghost'\]"):
        plan_buckets(params, ["a"], unused=["ghost"], strict=True)


def test_unknown_names_and_bad_caps_are_rejected() -> None:
    params = _specs(("a", (4,), F32))
    with pytest.raises(ConfigError, match="does not have"):
        plan_buckets(params, ["b"])
    with pytest.raises(ConfigError, match="must be > 0"):
        plan_buckets(params, ["a"], cap_bytes=0)
    with pytest.raises(ConfigError, match="power of two"):
        plan_buckets(params, ["a"], alignment_bytes=100)


def test_plan_renders_as_table_and_json_with_stable_fingerprint() -> None:
    params = _specs(("layer.weight", (64, 64), F32), ("layer.bias", (64,), F32))
    plan = plan_buckets(params, ["layer.bias", "layer.weight"], unused=[])
    table = plan.table()
    assert "bucket" in table and "all_reduce" in table and "layer.bias" in table
    data = json.loads(json.dumps(plan.to_json()))
    assert data["buckets"][0]["slots"][0]["name"] == "layer.bias"
    again = plan_buckets(params, ["layer.bias", "layer.weight"])
    assert plan.fingerprint() == again.fingerprint()
    other = plan_buckets(params, ["layer.bias", "layer.weight"], cap_bytes=2 * MIB)
    assert plan.fingerprint() != other.fingerprint()


def test_automatic_cap_aims_for_eight_buckets_within_bounds() -> None:
    four_layers = _specs(*[(f"w{i}", (1024, 1024), F32) for i in range(4)])  # 16 MiB
    huge = _specs(*[(f"w{i}", (4096, 4096), F32) for i in range(32)])  # 2 GiB
    no_latency = {"alpha_s": 0.0}  # the bare rule: bytes / 8 within [1, 25] MiB
    assert auto_bucket_cap(four_layers, **no_latency) == 2 * MIB
    assert auto_bucket_cap(_specs(("tiny", (10,), F32)), **no_latency) == MIB
    assert auto_bucket_cap(huge, **no_latency) == 25 * MIB
    # with gloo's measured latency, no cap is below twice the latency floor
    floor = latency_floor_bytes()
    assert auto_bucket_cap(four_layers) == auto_bucket_cap(_specs(("tiny", (10,), F32)))
    assert auto_bucket_cap(four_layers) == 2 * floor > 2 * MIB
    assert auto_bucket_cap(huge) == 25 * MIB


# -- the alpha-beta rule -----------------------------------------------------------------


def _mlp_specs(width: int, layers: int = 4) -> tuple[list[ParamSpec], list[str]]:
    """An nn.Sequential of ``layers`` x Linear(width, width) with ReLU between: its
    parameters and their gradient-ready order (last layer first, bias before weight)."""
    names = [f"{2 * k}" for k in range(layers)]
    specs = []
    for n in names:
        specs += _specs((f"{n}.weight", (width, width), F32), (f"{n}.bias", (width,), F32))
    order = [f"{n}.{kind}" for n in reversed(names) for kind in ("bias", "weight")]
    return specs, order


def _auto_plan(specs: list[ParamSpec], order: list[str], **cost: float) -> BucketPlan:
    """What dp's planner plans with bucket_cap_mb=None (default first 1 MiB)."""
    return plan_buckets(specs, order, cap_bytes=auto_bucket_cap(specs, **cost), **cost)


def test_latency_floor_is_where_latency_is_a_quarter_of_the_collective() -> None:
    floor = latency_floor_bytes(GLOO_ALPHA_S, GLOO_BETA_S_PER_BYTE)
    assert floor == int(3 * GLOO_ALPHA_S / GLOO_BETA_S_PER_BYTE)
    latency_share = GLOO_ALPHA_S / (GLOO_ALPHA_S + floor * GLOO_BETA_S_PER_BYTE)
    assert latency_share == pytest.approx(LATENCY_FRACTION, rel=1e-6)
    assert 1 * MIB < floor < 4 * MIB  # gloo on one host: ~0.4 ms, ~1.5 GB/s
    assert latency_floor_bytes(0.0, 1e-9) == 0
    with pytest.raises(ConfigError, match="beta_s_per_byte > 0"):
        latency_floor_bytes(1e-4, 0.0)


def test_small_mlp_biases_ride_with_their_weights_in_few_buckets() -> None:
    specs, order = _mlp_specs(512)  # 4 x Linear(512, 512): 4 MiB of gradients
    plan = _auto_plan(specs, order)
    names = [b.param_names for b in plan.buckets]
    assert len(plan.buckets) <= 3, names
    assert all(any(n.endswith(".weight") for n in b) for b in names), names  # no lone bias
    # the first bucket (1 MiB as DDP's) takes the floor too: two halves, not 1 + 3 MiB
    assert names == [tuple(order[:4]), tuple(order[4:])]
    # on 4 ranks a ring pays three times the latency: one bucket
    alpha, beta = ring_all_reduce_cost(4)
    four = _auto_plan(specs, order, alpha_s=alpha, beta_s_per_byte=beta)
    assert [b.param_names for b in four.buckets] == [tuple(order)]
    # a first bucket the user sizes keeps its meaning: DDP's 1 MiB split
    ddp_like = plan_buckets(specs, order, cap_bytes=plan.cap_bytes, first_bucket_bytes=MIB)
    assert ddp_like.buckets[0].param_names == ("6.bias", "6.weight")
    # the old rule (no latency term) paid eight latencies, four for a lone 2 KiB bias
    bare = _auto_plan(specs, order, alpha_s=0.0)
    assert len(bare.buckets) == 8 and bare.buckets[0].param_names == ("6.bias",)


def test_no_bucket_but_the_last_is_latency_bound() -> None:
    floor = latency_floor_bytes()
    for width, layers in ((512, 4), (1024, 4), (1024, 48), (256, 12), (2048, 6)):
        specs, order = _mlp_specs(width, layers)
        plan = _auto_plan(specs, order)
        first, middle = plan.buckets[0], plan.buckets[1:-1]
        assert first.nbytes >= min(floor, plan.first_bucket_bytes // 2)
        assert all(b.nbytes >= floor for b in middle), (width, layers, plan.table())
        assert sum(b.nbytes for b in plan.buckets) < 1.01 * sum(
            p.numel * 4 for p in specs
        )  # alignment padding only


def test_large_model_still_gets_several_buckets_for_overlap() -> None:
    specs, order = _mlp_specs(1024, 48)  # 192 MiB of gradients
    plan = _auto_plan(specs, order)
    assert 6 <= len(plan.buckets) <= 12
    assert all(b.nbytes <= plan.cap_bytes + 8 * 1024 for b in plan.buckets)
    assert plan.buckets[0].param_names == ("94.bias", "94.weight")  # starts early


def test_latency_and_bandwidth_move_the_boundaries() -> None:
    specs, order = _mlp_specs(1024)  # 16 MiB: with gloo's figures, one layer per bucket
    measured = _auto_plan(specs, order)
    slow_start = _auto_plan(specs, order, alpha_s=10 * GLOO_ALPHA_S)  # e.g. more ranks
    assert len(slow_start.buckets) < len(measured.buckets) == 4
    assert len(slow_start.buckets) == 1  # all of it at once
    small, small_order = _mlp_specs(512)  # 4 MiB: two buckets with gloo's figures
    thin_pipe = _auto_plan(small, small_order, beta_s_per_byte=10 * GLOO_BETA_S_PER_BYTE)
    assert len(_auto_plan(small, small_order).buckets) == 2 < len(thin_pipe.buckets) == 4
    # a bandwidth-bound network splits at every layer: each bucket one weight and its bias
    assert all(len(b.param_names) == 2 for b in thin_pipe.buckets)


def test_a_ring_scales_latency_with_its_steps_and_bytes_with_its_share() -> None:
    assert ring_all_reduce_cost(2) == (GLOO_ALPHA_S, GLOO_BETA_S_PER_BYTE)  # measured there
    alpha, beta = ring_all_reduce_cost(8)
    assert alpha == pytest.approx(7 * GLOO_ALPHA_S)  # 14 steps against 2
    assert beta == pytest.approx(1.75 * GLOO_BETA_S_PER_BYTE)  # 2 (P-1) / P of the buffer


def test_explicit_small_caps_still_split() -> None:
    """A user-set cap keeps its meaning: the floor is at most half of it."""
    specs, order = _mlp_specs(64, 6)  # 16 KiB + 256 B per layer
    plan = plan_buckets(specs, order, cap_bytes=40_000, first_bucket_bytes=1_000)
    assert plan.buckets[0].param_names == ("10.bias", "10.weight")
    assert len(plan.buckets) >= 3
    assert all(b.nbytes <= 40_000 for b in plan.buckets)
