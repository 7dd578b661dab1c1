"""Named kernels with a launch geometry, a pure-torch reference, and per-backend implementations.

A kernel is *defined* once with a :class:`KernelSpec` (name, doc, a pure-torch reference
that serves as the test oracle, and a function that computes its default
:class:`LaunchConfig` from the call's arguments). Backends then *register* faster
implementations under their backend name. A :class:`KernelLauncher` bound to a backend
runs that backend's implementation when there is one and falls back to the reference
otherwise.

Every implementation is called as ``fn(config, *args, **kwargs)``; implementations that
have no use for the launch geometry (pure-torch ones) simply ignore ``config``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lamina.errors import KernelError

__all__ = [
    "REFERENCE",
    "Dim3",
    "KernelFn",
    "KernelLauncher",
    "KernelRegistry",
    "KernelSpec",
    "LaunchConfig",
    "builtin_registry",
    "check_scale_accumulate_args",
    "elementwise_geometry",
    "prepare_pack_bucket",
]

#: The implementation name reported when a kernel runs its pure-torch reference.
REFERENCE = "reference"


@dataclass(frozen=True)
class Dim3:
    """A launch dimension (grid or block): ``x``, ``y``, ``z`` are ints >= 1."""

    x: int = 1
    y: int = 1
    z: int = 1

    def __post_init__(self) -> None:
        for field in ("x", "y", "z"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Dim3.{field} must be an int >= 1, got {value!r}")

    @property
    def volume(self) -> int:
        """The number of points, ``x * y * z``."""
        return self.x * self.y * self.z


@dataclass(frozen=True)
class LaunchConfig:
    """Where a kernel runs: ``grid`` blocks of ``block`` threads each."""

    grid: Dim3
    block: Dim3


#: A kernel implementation; every one is called as ``fn(config: LaunchConfig, *args, **kwargs)``.
KernelFn = Callable[..., Any]


@dataclass(frozen=True)
class KernelSpec:
    """The definition of a named kernel.

    ``reference`` is the pure-torch implementation and the oracle that backend
    implementations are tested against; ``geometry`` receives the same positional and
    keyword arguments as the kernel (without ``config``) and returns the default
    :class:`LaunchConfig`.
    """

    name: str
    doc: str
    reference: KernelFn
    geometry: Callable[..., LaunchConfig]


def _known(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "(none)"


class KernelRegistry:
    """Kernel definitions plus the backend implementations registered for them.

    Thread-safe; lookups see registrations made after a launcher was created.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._specs: dict[str, KernelSpec] = {}
        self._impls: dict[str, dict[str, KernelFn]] = {}

    def define(self, spec: KernelSpec) -> None:
        """Define a kernel; :class:`KernelError` if its name is already defined."""
        if not isinstance(spec, KernelSpec):
            raise KernelError(f"define() takes a KernelSpec, got {type(spec).__name__}")
        if not isinstance(spec.name, str) or not spec.name:
            raise KernelError(f"kernel name must be a non-empty string, got {spec.name!r}")
        if not callable(spec.reference) or not callable(spec.geometry):
            raise KernelError(
                f"kernel {spec.name!r}: reference and geometry must both be callables"
            )
        with self._lock:
            if spec.name in self._specs:
                raise KernelError(
                    f"kernel {spec.name!r} is already defined; pick another name or "
                    f"register() a backend implementation for it instead"
                )
            self._specs[spec.name] = spec
            self._impls[spec.name] = {}

    def register(self, name: str, backend: str, fn: KernelFn) -> None:
        """Register ``backend``'s implementation of kernel ``name``; a later one replaces it.

        :class:`KernelError` if the kernel is not defined, the backend name is empty or
        the reserved ``"reference"``, or ``fn`` is not callable.
        """
        if not isinstance(backend, str) or not backend:
            raise KernelError(f"kernel {name!r}: backend must be a non-empty string")
        if backend == REFERENCE:
            raise KernelError(
                f"kernel {name!r}: backend name {REFERENCE!r} is reserved for the "
                f"pure-torch reference; register under the backend's own name"
            )
        if not callable(fn):
            raise KernelError(
                f"kernel {name!r}, backend {backend!r}: implementation must be callable, "
                f"got {type(fn).__name__}"
            )
        with self._lock:
            impls = self._impls.get(name)
            if impls is None:
                raise KernelError(
                    f"cannot register backend {backend!r} for unknown kernel {name!r}; "
                    f"define() it first; known kernels: {_known(sorted(self._specs))}"
                )
            impls[backend] = fn

    def names(self) -> list[str]:
        """The defined kernel names, sorted."""
        with self._lock:
            return sorted(self._specs)

    def spec(self, name: str) -> KernelSpec:
        """The :class:`KernelSpec` of ``name``; :class:`KernelError` listing known names if none."""
        with self._lock:
            spec = self._specs.get(name)
            if spec is None:
                raise KernelError(
                    f"unknown kernel {name!r}; known kernels: {_known(sorted(self._specs))}"
                )
            return spec

    def implementation(self, name: str, backend: str) -> tuple[KernelFn, str]:
        """``(fn, backend)`` if ``backend`` registered one, else ``(reference, REFERENCE)``."""
        spec = self.spec(name)
        with self._lock:
            fn = self._impls[name].get(backend)
        if fn is None:
            return spec.reference, REFERENCE
        return fn, backend

    def backends_for(self, name: str) -> list[str]:
        """The backends with an implementation of ``name``, sorted (the reference not included)."""
        self.spec(name)
        with self._lock:
            return sorted(self._impls[name])


class KernelLauncher:
    """Runs kernels of a registry for one backend, falling back to the reference."""

    def __init__(self, registry: KernelRegistry, backend: str) -> None:
        if not isinstance(registry, KernelRegistry):
            raise KernelError(
                f"KernelLauncher needs a KernelRegistry, got {type(registry).__name__}"
            )
        if not isinstance(backend, str) or not backend:
            raise KernelError(f"KernelLauncher backend must be a non-empty string, got {backend!r}")
        self._registry = registry
        self._backend = backend

    @property
    def registry(self) -> KernelRegistry:
        """The registry kernels are looked up in."""
        return self._registry

    @property
    def backend(self) -> str:
        """The backend name whose implementations are preferred."""
        return self._backend

    def launch(
        self,
        name: str,
        *args: Any,
        grid: Dim3 | None = None,
        block: Dim3 | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run kernel ``name`` with the backend's implementation (or the reference).

        The launch config is ``spec.geometry(*args, **kwargs)`` unless ``grid`` and/or
        ``block`` are given; one given alone replaces only its half of the default.
        """
        spec = self._registry.spec(name)
        for label, dim in (("grid", grid), ("block", block)):
            if dim is not None and not isinstance(dim, Dim3):
                raise KernelError(
                    f"launch({name!r}): {label} must be a Dim3, got {type(dim).__name__}"
                )
        if grid is None or block is None:
            default = spec.geometry(*args, **kwargs)
            grid = default.grid if grid is None else grid
            block = default.block if block is None else block
        fn, _ = self._registry.implementation(name, self._backend)
        return fn(LaunchConfig(grid=grid, block=block), *args, **kwargs)

    def reference(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run the pure-torch reference of ``name`` with its default geometry."""
        spec = self._registry.spec(name)
        return spec.reference(spec.geometry(*args, **kwargs), *args, **kwargs)

    def implementation_name(self, name: str) -> str:
        """The backend name whose implementation :meth:`launch` runs, or ``REFERENCE``."""
        return self._registry.implementation(name, self._backend)[1]


def elementwise_geometry(numel: int, block: int = 256) -> LaunchConfig:
    """One thread per element: ``grid.x = ceil(numel / block)`` (at least 1)."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"elementwise_geometry: numel must be an int >= 0, got {numel!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"elementwise_geometry: block must be an int >= 1, got {block!r}")
    return LaunchConfig(grid=Dim3(max(1, -(-numel // block))), block=Dim3(block))


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


# --------------------------------------------------------------------------- built-ins

_BUILTINS = (
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


def builtin_registry() -> KernelRegistry:
    """A new registry with the built-in kernels defined (and no backend implementations)."""
    from lamina.device.fp8_kernels import FP8_KERNELS  # it builds on this module

    registry = KernelRegistry()
    for spec in (*_BUILTINS, *FP8_KERNELS):
        registry.define(spec)
    return registry
