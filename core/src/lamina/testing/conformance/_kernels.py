"""Kernel checks of the conformance kit: samples and the comparison with the reference.

Every kernel is compared with its reference bit for bit (:func:`bit_for_bit`) unless
:data:`KERNEL_COMPARISONS` names a bound for it: pack/unpack are copies and the fp8
kernels are exact by construction (power-of-two scales, one rounding to e4m3), so any
difference is a wrong kernel. ``scale_accumulate`` alone may round differently, within
:func:`multiply_add_bound`. The samples hold values that a kernel flushing small
outputs to zero, or denormals, gets wrong: outputs under 1e-6, fp32 denormals, ``-0.0``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lamina.testing.conformance._common import aliasing_of, clone_args, to_cpu
from lamina.testing.conformance._compare import assert_same, assert_within

# --------------------------------------------------------------------------- comparisons

_Call = tuple[tuple[Any, ...], dict[str, Any]]
_Launch = Callable[[tuple[Any, ...], dict[str, Any]], Any]

#: What one call leaves behind, on the CPU: ``(result, args, kwargs)`` after the call.
KernelOutputs = tuple[Any, Any, Any]

#: Checks a launch's outputs against the reference's for one call (``got``, ``want``,
#: the call's arguments before it ran, a label); raises AssertionError on a difference.
KernelComparison = Callable[[KernelOutputs, KernelOutputs, _Call, str], None]


def bit_for_bit(got: KernelOutputs, want: KernelOutputs, call: _Call, label: str) -> None:
    """The result and the arguments after the call equal the reference's bit for bit."""
    assert_same(got[0], want[0], f"{label}: result")
    assert_same([got[1], got[2]], [want[1], want[2]], f"{label}: arguments after the call")


def multiply_add_bound(dst: torch.Tensor, src: torch.Tensor, scale: float) -> torch.Tensor:
    """How far two correct ``dst + scale * src`` may lie apart, per element (float64).

    One implementation may round once (a fused multiply-add), another twice (the product,
    then the sum). With ``u = eps / 2`` the unit roundoff of the dtype (fp32: 2**-24),
    the fused result is within ``u * |dst + scale*src|`` of the exact value and the unfused
    one within ``u * |scale*src| * (1 + u) + u * |dst + scale*src|``; their distance is at
    most ``2u|dst| + (3u + u**2)|scale*src|``, under ``eps * (|dst| + 2 * |scale*src|)``.
    In the denormal range rounding is absolute, up to half a denormal step per rounding:
    two denormal steps more cover it. Anything that rounds a tiny result to zero, or
    scales wrong, exceeds the bound.
    """
    info = torch.finfo(dst.dtype)
    product = (float(scale) * src.detach().double()).abs()
    return info.eps * (dst.detach().double().abs() + 2 * product) + 2 * info.tiny * info.eps


def _argument(call: _Call, index: int, name: str) -> Any:
    args, kwargs = call
    return args[index] if len(args) > index else kwargs[name]


def multiply_add_close(got: KernelOutputs, want: KernelOutputs, call: _Call, label: str) -> None:
    """``scale_accumulate``: ``dst`` (the result, and the argument after the call) within
    :func:`multiply_add_bound` of the reference's; every other argument bit for bit."""
    cpu_call = to_cpu(list(call))
    dst, src = _argument(cpu_call, 0, "dst"), _argument(cpu_call, 1, "src")
    bound = multiply_add_bound(dst, src, _argument(cpu_call, 2, "scale"))
    assert_within(got[0], want[0], bound, f"{label}: result")
    got_args, want_args = list(got[1]), list(want[1])
    got_kwargs, want_kwargs = dict(got[2]), dict(want[2])
    after = f"{label}: arguments after the call"
    if got_args and want_args:
        assert_within(got_args.pop(0), want_args.pop(0), bound, f"{after}[0]")
    elif "dst" in want_kwargs:
        assert_within(got_kwargs.pop("dst", None), want_kwargs.pop("dst"), bound, f"{after}['dst']")
    assert_same([got_args, got_kwargs], [want_args, want_kwargs], after)


#: How each built-in kernel is compared; a kernel not named here is compared bit for bit.
KERNEL_COMPARISONS: dict[str, KernelComparison] = {"scale_accumulate": multiply_add_close}


def comparison_for(name: str, comparisons: Mapping[str, KernelComparison]) -> KernelComparison:
    """The comparison of kernel ``name``: its entry in ``comparisons``, else bit for bit."""
    return comparisons.get(name, bit_for_bit)


def compare_calls(
    launch: _Launch,
    call: _Call,
    oracle: _Launch,
    oracle_call: _Call,
    sync: Callable[[], None],
    label: str,
    aliasing: bool = True,
    compare: KernelComparison = bit_for_bit,
) -> None:
    """``launch`` on copies of ``call`` against ``oracle`` on copies of ``oracle_call``.

    Results and the arguments after the call must agree (``compare``: bit for bit by
    default), and with ``aliasing`` which results alias their inputs.
    """
    got_args, got_kwargs = clone_args(call[0]), clone_args(call[1])
    want_args, want_kwargs = clone_args(oracle_call[0]), clone_args(oracle_call[1])
    got = launch(got_args, got_kwargs)
    want = oracle(want_args, want_kwargs)
    sync()
    compare(
        (to_cpu(got), to_cpu(got_args), to_cpu(got_kwargs)),
        (to_cpu(want), to_cpu(want_args), to_cpu(want_kwargs)),
        oracle_call,
        label,
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


# --------------------------------------------------------------------------- samples

#: Builds one call of a kernel on a device: ``(args, kwargs)``.
KernelSample = Callable[[torch.device], tuple[tuple[Any, ...], dict[str, Any]]]

#: Small values every float sample holds: under 1e-6 (normal in fp32), fp32 denormals
#: (under 2**-126 = 1.2e-38) and a negative zero. A backend that flushes small outputs
#: or denormals to zero, or loses the sign of zero, differs from the reference on them.
#: (No NaN: float outputs carry none, as a device's arithmetic may pick its own NaN bits.)
SMALL_VALUES = (3e-7, -2.5e-9, 1e-30, 3e-39, -1e-42, 1e-45, -0.0)


def _small(device: torch.device) -> torch.Tensor:
    return torch.tensor(SMALL_VALUES, dtype=torch.float32).to(device)


def _pack_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in [(7, 3), (5,), (2, 2, 2), ()]]
    tensors.insert(2, torch.tensor(SMALL_VALUES))
    return ([t.to(device) for t in tensors],), {}


def _pack_into_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (tensors,), _ = _pack_sample(device)
    return (tensors,), {"out": torch.full((64,), 7.0, device=device)}  # tail must be zeroed


def _unpack_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    flat = torch.arange(40, dtype=torch.float32)
    flat[9 : 9 + len(SMALL_VALUES)] = torch.tensor(SMALL_VALUES)  # in the first two shapes
    return (flat.to(device), [torch.Size([3, 4]), torch.Size([10]), torch.Size([2, 3, 3])]), {}


def _unpack_into_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (flat, shapes), _ = _unpack_sample(device)
    out = [torch.full(tuple(s), -1.0, device=device) for s in shapes]
    return (flat, shapes), {"out": out}


def _with_small_results(dst: torch.Tensor, src: torch.Tensor, at: slice) -> None:
    """Put :data:`SMALL_VALUES` in ``dst[at]`` and ``src[at]`` (src = dst: small results)."""
    dst[at] = torch.tensor(SMALL_VALUES)
    src[at] = torch.tensor(SMALL_VALUES)


def _scale_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    dst, src = (torch.randn(1000, generator=gen) for _ in range(2))
    _with_small_results(dst, src, slice(0, len(SMALL_VALUES)))
    return (dst.to(device), src.to(device), 0.25), {}


def _scale_odd_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(2)
    dst, src = (torch.randn(70_001, generator=gen) for _ in range(2))
    _with_small_results(dst, src, slice(-len(SMALL_VALUES), None))  # in the last block
    return (dst.to(device), src.to(device), -0.5), {}  # not a multiple of any block size


def _fp8_values(device: torch.device) -> torch.Tensor:
    """Nine blocks of 128: magnitudes 1e-6 to 1e3 (one per block), then fp32 denormals."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8 * 128, generator=gen) * torch.logspace(-6, 3, 8).repeat_interleave(128)
    x[5], x[130] = 0.0, 448.0  # a zero, and a block whose largest value is e4m3's largest
    x[256:384] = 0.0  # an all-zero block
    x[6], x[7] = -0.0, 1e-8  # a negative zero, and a value far under its block's largest
    x[137 : 137 + len(SMALL_VALUES)] = torch.tensor(SMALL_VALUES)
    denormals = torch.randn(128, generator=gen) * 1e-39  # scaled by 2**127 to e4m3 normals
    return torch.cat([x, denormals]).to(device)


def _fp8_quantize_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_fp8_values(device), 128), {}


def _fp8_quantize_into_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _fp8_values(device).to(torch.bfloat16)  # bf16 keeps the denormal block
    payload = torch.full((x.numel(),), 9, dtype=torch.uint8, device=device)
    exponents = torch.full((x.numel() // 64,), 9, dtype=torch.int8, device=device)
    return (x, 64), {"payload": payload, "exponents": exponents}


#: Per block of the dequantize sample, the scale exponent: outputs ``e4m3 * 2**-e`` range
#: from 448 * 2**20 down to fp32 denormals (e = 127: every value under 2 lands below 2**-126).
_DEQUANTIZE_EXPONENTS = (-20, 0, 8, 20, 40, 100, 120, 127)


def _fp8_dequantize_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(4)
    payload = torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=gen)
    payload[payload & 0x7F == 0x7F] = 1  # no NaN codes (see SMALL_VALUES)
    # in the 2**-127 block: -0.0 and the smallest e4m3 subnormals (fp32 denormals there)
    payload[897], payload[898], payload[899] = 0x80, 0x01, 0x81
    exponents = torch.tensor(_DEQUANTIZE_EXPONENTS, dtype=torch.int8)
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
