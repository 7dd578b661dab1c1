"""The bucket kernels ``pack_bucket``, ``unpack_bucket`` and ``scale_accumulate``.

Each is a :class:`~lamina.device.kernel_registry.KernelSpec` (a pure-torch reference and
its launch geometry) in :data:`BUCKET_KERNELS`, plus the argument checks every backend
implementation shares (:func:`prepare_pack_bucket`, :func:`check_scale_accumulate_args`),
so that they reject the same inputs with the same messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lamina.device.kernel_registry import KernelSpec, LaunchConfig, elementwise_geometry
from lamina.errors import KernelError

__all__ = [
    "BUCKET_KERNELS",
    "check_scale_accumulate_args",
    "prepare_pack_bucket",
]


# --------------------------------------------------------------------------- pack_bucket


def prepare_pack_bucket(
    tensors: Sequence[torch.Tensor], out: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """Validate ``pack_bucket``'s arguments; return ``(buffer, total)``.

    ``buffer`` is ``out`` with its tail beyond ``total`` zeroed, or a new 1-D tensor of
    exactly ``total`` elements. Shared by every ``pack_bucket`` implementation so that
    they reject the same inputs with the same messages.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise KernelError(
            f"pack_bucket: tensors must be a list or tuple of tensors, got {type(tensors).__name__}"
        )
    if len(tensors) == 0:
        raise KernelError("pack_bucket: tensors is empty; pass at least one tensor")
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        raise KernelError(f"pack_bucket: tensors[0] is a {type(first).__name__}, not a Tensor")
    total = 0
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise KernelError(f"pack_bucket: tensors[{i}] is a {type(t).__name__}, not a Tensor")
        if t.dtype != first.dtype:
            raise KernelError(
                f"pack_bucket: tensors[{i}] has dtype {t.dtype} but tensors[0] has "
                f"{first.dtype}; give every tensor of a bucket the same dtype"
            )
        if t.device != first.device:
            raise KernelError(
                f"pack_bucket: tensors[{i}] is on {t.device} but tensors[0] is on "
                f"{first.device}; put every tensor of a bucket on the same device"
            )
        total += t.numel()
    if out is None:
        return torch.empty(total, dtype=first.dtype, device=first.device), total
    if not isinstance(out, torch.Tensor):
        raise KernelError(f"pack_bucket: out is a {type(out).__name__}, not a Tensor")
    if out.dim() != 1:
        raise KernelError(f"pack_bucket: out must be 1-D, got shape {tuple(out.shape)}")
    if out.dtype != first.dtype:
        raise KernelError(
            f"pack_bucket: out has dtype {out.dtype} but the tensors have {first.dtype}; "
            f"allocate out with dtype {first.dtype}"
        )
    if out.device != first.device:
        raise KernelError(
            f"pack_bucket: out is on {out.device} but the tensors are on {first.device}; "
            f"allocate out on {first.device}"
        )
    if out.numel() < total:
        raise KernelError(
            f"pack_bucket: out has {out.numel()} elements but the tensors need {total}; "
            f"pass an out of at least {total} elements"
        )
    if out.numel() > total:
        with torch.no_grad():
            out.narrow(0, total, out.numel() - total).zero_()
    return out, total


def _pack_bucket_reference(
    config: LaunchConfig, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy ``tensors`` in order, flattened, into one 1-D buffer (one narrow().copy_() each)."""
    buffer, _ = prepare_pack_bucket(tensors, out)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            buffer.narrow(0, offset, n).copy_(t.reshape(-1))
            offset += n
    return buffer


def _pack_bucket_geometry(tensors: Any, out: Any = None) -> LaunchConfig:
    # Lenient on bad arguments: the implementation reports them with a KernelError.
    total = 0
    if isinstance(tensors, Sequence):
        total = sum(t.numel() for t in tensors if isinstance(t, torch.Tensor))
    return elementwise_geometry(total)


# --------------------------------------------------------------------------- unpack_bucket


def _shape_or_none(shape: Any) -> tuple[int, ...] | None:
    if isinstance(shape, torch.Tensor) or not isinstance(shape, Sequence):
        return None
    dims = tuple(shape)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            return None
    return dims


def _unpack_bucket_reference(
    config: LaunchConfig,
    flat: torch.Tensor,
    shapes: Sequence[torch.Size | tuple[int, ...]],
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Split ``flat`` into tensors of ``shapes``: views of ``flat``, or copies into ``out``."""
    if not isinstance(flat, torch.Tensor):
        raise KernelError(f"unpack_bucket: flat is a {type(flat).__name__}, not a Tensor")
    if flat.dim() != 1:
        raise KernelError(f"unpack_bucket: flat must be 1-D, got shape {tuple(flat.shape)}")
    if isinstance(shapes, torch.Tensor) or not isinstance(shapes, Sequence):
        raise KernelError(
            f"unpack_bucket: shapes must be a list of shapes, got {type(shapes).__name__}"
        )
    dims_list: list[tuple[int, ...]] = []
    for i, shape in enumerate(shapes):
        dims = _shape_or_none(shape)
        if dims is None:
            raise KernelError(
                f"unpack_bucket: shapes[{i}] = {shape!r} is not a shape; "
                f"give a torch.Size or tuple of ints >= 0"
            )
        dims_list.append(dims)
    total = sum(math.prod(d) for d in dims_list)
    if flat.numel() < total:
        raise KernelError(
            f"unpack_bucket: flat has {flat.numel()} elements but the shapes need {total}; "
            f"pass a flat buffer of at least {total} elements"
        )
    if out is not None:
        if isinstance(out, torch.Tensor) or not isinstance(out, Sequence):
            raise KernelError(
                f"unpack_bucket: out must be a list of tensors, got {type(out).__name__}"
            )
        if len(out) != len(dims_list):
            raise KernelError(
                f"unpack_bucket: out has {len(out)} tensors but shapes has {len(dims_list)}; "
                f"pass one out tensor per shape"
            )
        for i, (o, dims) in enumerate(zip(out, dims_list, strict=True)):
            if not isinstance(o, torch.Tensor):
                raise KernelError(f"unpack_bucket: out[{i}] is a {type(o).__name__}, not a Tensor")
            if tuple(o.shape) != dims:
                raise KernelError(
                    f"unpack_bucket: out[{i}] has shape {tuple(o.shape)} but shapes[{i}] is "
                    f"{dims}; allocate out[{i}] with shape {dims}"
                )
            if o.dtype != flat.dtype or o.device != flat.device:
                raise KernelError(
                    f"unpack_bucket: out[{i}] is {o.dtype} on {o.device} but flat is "
                    f"{flat.dtype} on {flat.device}; allocate out[{i}] like flat"
                )
    views: list[torch.Tensor] = []
    offset = 0
    for dims in dims_list:
        n = math.prod(dims)
        views.append(flat.narrow(0, offset, n).view(dims))
        offset += n
    if out is None:
        return views
    with torch.no_grad():
        for o, v in zip(out, views, strict=True):
            o.copy_(v)
    return list(out)


def _unpack_bucket_geometry(flat: Any, shapes: Any, out: Any = None) -> LaunchConfig:
    total = 0
    if isinstance(shapes, Sequence) and not isinstance(shapes, torch.Tensor):
        for shape in shapes:
            dims = _shape_or_none(shape)
            if dims is not None:
                total += math.prod(dims)
    return elementwise_geometry(total)


# --------------------------------------------------------------------------- scale_accumulate


def check_scale_accumulate_args(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """Validate ``scale_accumulate``'s arguments (shared by every implementation)."""
    if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
        raise KernelError(
            f"scale_accumulate: dst and src must be Tensors, got "
            f"{type(dst).__name__} and {type(src).__name__}"
        )
    if dst.shape != src.shape:
        raise KernelError(
            f"scale_accumulate: dst has shape {tuple(dst.shape)} but src has "
            f"{tuple(src.shape)}; pass tensors of the same shape"
        )
    if dst.dtype != src.dtype:
        raise KernelError(
            f"scale_accumulate: dst has dtype {dst.dtype} but src has {src.dtype}; "
            f"cast src to {dst.dtype}"
        )
    if dst.device != src.device:
        raise KernelError(
            f"scale_accumulate: dst is on {dst.device} but src is on {src.device}; "
            f"move src to {dst.device}"
        )
    if not (dst.is_floating_point() or dst.is_complex()):
        raise KernelError(
            f"scale_accumulate: dtype {dst.dtype} is not floating point; "
            f"accumulate into a floating-point tensor"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise KernelError(
            f"scale_accumulate: scale must be a Python float, got {type(scale).__name__}"
        )


def _scale_accumulate_reference(
    config: LaunchConfig, dst: torch.Tensor, src: torch.Tensor, scale: float
) -> torch.Tensor:
    """``dst += scale * src`` in place; returns ``dst``.

    Computed out of place with ``torch.add(dst, src, alpha=scale)`` and copied back, so
    that the rounding is torch's own (a fused multiply-add where the CPU has one); a
    separate ``scale * src`` followed by an add rounds twice and can differ in the last bit.
    """
    check_scale_accumulate_args(dst, src, scale)
    with torch.no_grad():
        dst.copy_(torch.add(dst, src, alpha=scale))
    return dst


def _scale_accumulate_geometry(dst: Any, src: Any = None, scale: Any = None) -> LaunchConfig:
    return elementwise_geometry(dst.numel() if isinstance(dst, torch.Tensor) else 0)


# --------------------------------------------------------------------------- specs

#: The bucket kernels' definitions.
BUCKET_KERNELS = (
    KernelSpec(
        name="pack_bucket",
        doc=(
            "pack_bucket(config, tensors, out=None) -> Tensor: copy tensors in order, "
            "flattened, into one 1-D buffer (out, tail zeroed, or a new exact-size tensor)."
        ),
        reference=_pack_bucket_reference,
        geometry=_pack_bucket_geometry,
    ),
    KernelSpec(
        name="unpack_bucket",
        doc=(
            "unpack_bucket(config, flat, shapes, out=None) -> list[Tensor]: views of flat "
            "with the given shapes, or copies into out."
        ),
        reference=_unpack_bucket_reference,
        geometry=_unpack_bucket_geometry,
    ),
    KernelSpec(
        name="scale_accumulate",
        doc="scale_accumulate(config, dst, src, scale) -> Tensor: dst += scale * src in place.",
        reference=_scale_accumulate_reference,
        geometry=_scale_accumulate_geometry,
    ),
)
