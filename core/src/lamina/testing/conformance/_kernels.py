"""Kernel checks of the conformance kit: samples and the comparison with the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lamina.testing.conformance._common import (
    aliasing_of,
    assert_close,
    clone_args,
    to_cpu,
)

# --------------------------------------------------------------------------- kernels

_Call = tuple[tuple[Any, ...], dict[str, Any]]
_Launch = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def compare_calls(
    launch: _Launch,
    call: _Call,
    oracle: _Launch,
    oracle_call: _Call,
    sync: Callable[[], None],
    label: str,
    aliasing: bool = True,
) -> None:
    """``launch`` on copies of ``call`` against ``oracle`` on copies of ``oracle_call``.

    Results and the arguments after the call must agree, and with ``aliasing`` which
    results alias their inputs.
    """
    got_args, got_kwargs = clone_args(call[0]), clone_args(call[1])
    want_args, want_kwargs = clone_args(oracle_call[0]), clone_args(oracle_call[1])
    got = launch(got_args, got_kwargs)
    want = oracle(want_args, want_kwargs)
    sync()
    assert_close(to_cpu(got), to_cpu(want), f"{label}: result")
    assert_close(
        to_cpu([got_args, got_kwargs]),
        to_cpu([want_args, want_kwargs]),
        f"{label}: arguments after the call",
    )
    if not aliasing:
        return
    got_alias = aliasing_of(got, [got_args, got_kwargs])
    want_alias = aliasing_of(want, [want_args, want_kwargs])
    if got_alias is not None and want_alias is not None:
        assert got_alias == want_alias, (
            f"{label}: results alias the inputs {got_alias}, the reference's "
            f"{want_alias} (views / in-place / out= differ)"
        )


#: Builds one call of a kernel on a device: ``(args, kwargs)``.
KernelSample = Callable[[torch.device], tuple[tuple[Any, ...], dict[str, Any]]]


def _pack_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen).to(device) for s in [(7, 3), (5,), (2, 2, 2), ()]]
    return (tensors,), {}


def _pack_into_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (tensors,), _ = _pack_sample(device)
    return (tensors,), {"out": torch.full((64,), 7.0, device=device)}  # tail must be zeroed


def _unpack_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    flat = torch.arange(40, dtype=torch.float32, device=device)
    return (flat, [torch.Size([3, 4]), torch.Size([10]), torch.Size([2, 3, 3])]), {}


def _unpack_into_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (flat, shapes), _ = _unpack_sample(device)
    out = [torch.full(tuple(s), -1.0, device=device) for s in shapes]
    return (flat, shapes), {"out": out}


def _scale_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    dst, src = (torch.randn(1000, generator=gen).to(device) for _ in range(2))
    return (dst, src, 0.25), {}


def _scale_odd_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(2)
    dst, src = (torch.randn(70_001, generator=gen).to(device) for _ in range(2))
    return (dst, src, -0.5), {}  # not a multiple of any block size; exact in any order


def _fp8_values(device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8 * 128, generator=gen) * torch.logspace(-6, 3, 8).repeat_interleave(128)
    x[5], x[130] = 0.0, 448.0  # a zero, and a block whose largest value is e4m3's largest
    x[256:384] = 0.0  # an all-zero block
    return x.to(device)


def _fp8_quantize_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_fp8_values(device), 128), {}


def _fp8_quantize_into_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _fp8_values(device).to(torch.bfloat16)
    payload = torch.full((x.numel(),), 9, dtype=torch.uint8, device=device)
    exponents = torch.full((x.numel() // 64,), 9, dtype=torch.int8, device=device)
    return (x, 64), {"payload": payload, "exponents": exponents}


def _fp8_dequantize_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(4)
    payload = torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=gen)
    payload[payload & 0x7F == 0x7F] = 1  # no NaN bits: NaN != NaN in the comparison
    exponents = torch.randint(-20, 20, (8,), dtype=torch.int8, generator=gen)
    return (payload.to(device), exponents.to(device), 128), {}


def _fp8_dequantize_into_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (payload, exponents, _), _ = _fp8_dequantize_sample(device)
    out = torch.full((payload.numel(),), -1.0, device=device)
    return (payload, exponents.repeat_interleave(2), 64), {"out": out}


#: Calls of every built-in kernel; a plugin's own kernels bring their own (``kernel_samples``).
KERNEL_SAMPLES: dict[str, tuple[KernelSample, ...]] = {
    "pack_bucket": (_pack_sample, _pack_into_sample),
    "unpack_bucket": (_unpack_sample, _unpack_into_sample),
    "scale_accumulate": (_scale_sample, _scale_odd_sample),
    "fp8_quantize": (_fp8_quantize_sample, _fp8_quantize_into_sample),
    "fp8_dequantize": (_fp8_dequantize_sample, _fp8_dequantize_into_sample),
}
