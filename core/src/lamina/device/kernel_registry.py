"""The kernel registry and launch types: specs, per-backend implementations, the launcher.

A kernel is *defined* once with a :class:`KernelSpec` (name, doc, a pure-torch reference
that serves as the test oracle, and a function that computes its default
:class:`LaunchConfig` from the call's arguments). Backends then *register* faster
implementations under their backend name. A :class:`KernelLauncher` bound to a backend
runs that backend's implementation when there is one and falls back to the reference
otherwise.

Every implementation is called as ``fn(config, *args, **kwargs)``; implementations that
have no use for the launch geometry (pure-torch ones) simply ignore ``config``.

The kernels themselves are defined on top of this module (:mod:`lamina.device.bucket_kernels`,
:mod:`lamina.device.fp8_kernels`) and gathered by :mod:`lamina.device.kernels`; this module
imports none of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lamina.errors import KernelError

__all__ = [
    "REFERENCE",
    "Dim3",
    "KernelFn",
    "KernelLauncher",
    "KernelRegistry",
    "KernelSpec",
    "LaunchConfig",
    "elementwise_geometry",
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
