"""Comparing outputs with the reference's: bit for bit, or within a stated bound.

Bit for bit means the same type, shape and dtype, and every element's bit pattern equal:
``-0.0`` is not ``0.0``, a NaN's payload and sign count, and a denormal flushed to zero
is a difference however small it is.
"""

from __future__ import annotations

from typing import Any

import torch

#: The integer dtype of each element width, to read a tensor's bit patterns.
_BITS_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _elements(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat in logical order, contiguous (complex: real and imaginary parts)."""
    flat = t.detach().reshape(-1).contiguous()
    return torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat


def bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t``'s elements in logical order, as a 1-D integer tensor
    (complex elements as their real and imaginary parts)."""
    flat = _elements(t)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    return flat.view(_BITS_OF_WIDTH[flat.element_size()])


def _same_scalar(got: Any, want: Any) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        return got.hex() == want.hex()  # -0.0 and NaN are themselves only
    return bool(type(got) is type(want) and got == want)


def _tensor_header(got: Any, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, want a Tensor"
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: got {got.dtype}{tuple(got.shape)}, the reference gives "
        f"{want.dtype}{tuple(want.shape)}"
    )


def assert_same(got: Any, want: Any, what: str) -> None:
    """``got`` equals the reference's ``want`` bit for bit, walking lists, tuples and dicts."""
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (
            f"{what}: got {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'}"
            f" items, the reference gives {len(want)}"
        )
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{what}[{i}]")
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{what}: keys differ"
        for key in want:
            assert_same(got[key], want[key], f"{what}[{key!r}]")
        return
    if isinstance(want, torch.Tensor):
        _tensor_header(got, want, what)
        got_bits, want_bits = bit_patterns(got), bit_patterns(want)
        differ = (got_bits != want_bits).nonzero().flatten()
        if differ.numel():
            i = int(differ[0])
            mask = (1 << 8 * got_bits.element_size()) - 1  # the bits as an unsigned number
            flat_got, flat_want = _elements(got), _elements(want)
            raise AssertionError(
                f"{what}: {differ.numel()} of {want_bits.numel()} elements differ from the "
                f"reference bit for bit; first at flat index {i}: got {flat_got[i].item()!r} (bits "
                f"{int(got_bits[i]) & mask:#x}), want {flat_want[i].item()!r} (bits "
                f"{int(want_bits[i]) & mask:#x})"
            )
        return
    assert _same_scalar(got, want), f"{what}: got {got!r}, the reference gives {want!r}"


def assert_within(got: Any, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """``|got - want| <= bound`` element by element (float64 arithmetic); where the
    reference is not finite, ``got`` must be the same infinity, or a NaN where it is NaN."""
    _tensor_header(got, want, what)
    g = got.detach().reshape(-1).double()
    w = want.detach().reshape(-1).double()
    limit = bound.reshape(-1).double()
    finite = torch.isfinite(w)
    error = torch.where(finite, (g - w).abs(), torch.zeros_like(w))
    special_ok = (g == w) | (g.isnan() & w.isnan())
    bad = (finite & ~(error <= limit)) | (~finite & ~special_ok)
    if bool(bad.any()):
        ratio = torch.where(bad, error / limit.clamp_min(torch.finfo(torch.float64).tiny), -1)
        i = int(ratio.argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {w.numel()} elements differ from the reference by "
            f"more than the bound; worst at flat index {i}: got {g[i].item()!r}, want "
            f"{w[i].item()!r}, bound {limit[i].item():.3g}"
        )
