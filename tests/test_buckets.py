"""Bucket planning: order, dtype homogeneity, caps, alignment, exclusions, rendering."""

from __future__ import annotations

import json

import pytest
import torch

from lamina.comm.buckets import MIB, ParamSpec, plan_buckets
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
        params, ["small", "huge", "tail"], cap_bytes=MIB // 2, first_bucket_bytes=MIB // 2
    )
    assert [b.param_names for b in plan.buckets] == [("small",), ("huge",), ("tail",)]


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
    from lamina.comm.buckets import auto_bucket_cap

    four_layers = _specs(*[(f"w{i}", (1024, 1024), F32) for i in range(4)])  # 16 MiB
    assert auto_bucket_cap(four_layers) == 2 * MIB
    assert auto_bucket_cap(_specs(("tiny", (10,), F32))) == MIB
    assert auto_bucket_cap(_specs(*[(f"w{i}", (4096, 4096), F32) for i in range(32)])) == 25 * MIB
