"""Plugin loading: entry-point discovery, isolation of broken plugins, backend selection."""

from __future__ import annotations

import importlib.metadata as md
import os
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from lamina import hookspecs
from lamina.device.backend import Availability, Backend
from lamina.device.kernels import KernelRegistry, builtin_registry
from lamina.errors import BackendNotFoundError, BackendUnavailableError

#: Environment variable that names the backend to use, overriding priorities.
BACKEND_ENV = "LAMINA_BACKEND"

PluginStatus = Literal["loaded", "failed"]


@dataclass
class PluginRecord:
    """One plugin found through an entry point, and what became of it."""

    name: str
    target: str
    distribution: str | None
    version: str | None
    status: PluginStatus = "loaded"
    #: Where it failed (``"import"``, ``"validation"`` or ``"hook <name>"``) and why.
    stage: str | None = None
    error: str | None = None
    backends: list[str] = field(default_factory=list)

    def fail(self, stage: str, exc: BaseException) -> None:
        """Mark the plugin failed at ``stage`` with ``exc`` (first failure wins)."""
        if self.status == "failed":
            return
        self.status = "failed"
        self.stage = stage
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        self.error = last


@dataclass
class BackendEntry:
    """A registered backend, the plugin that provided it, and its availability."""

    backend: Backend
    plugin: str
    _availability: Availability | None = field(default=None, repr=False)

    @property
    def availability(self) -> Availability:
        """Probed on first use, then kept: probing imports the vendor runtime (torch_xla
        takes seconds), which a process that selects another backend by name never needs."""
        if self._availability is None:
            self._availability = _probe(self.backend)
        return self._availability


class PluginRegistry:
    """The loaded plugins, their backends and kernels; build with :func:`load_plugins`."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.backends: dict[str, BackendEntry] = {}
        self.kernels: KernelRegistry = builtin_registry()

    # -- loading ---------------------------------------------------------------------
    def add(self, plugin: object, record: PluginRecord) -> None:
        """Register ``plugin`` under ``record.name``; a validation failure is recorded."""
        self.records[record.name] = record
        try:
            self.manager.register(plugin, name=record.name)
            self.manager.check_pending()
        except Exception as exc:
            record.fail("validation", exc)
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)

    def call_isolated(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation of ``hook_name`` in registration order.

        A plugin whose implementation raises is marked failed and unregistered; the
        others still run. Returns ``(plugin name, result)`` pairs.
        """
        caller = getattr(self.manager.hook, hook_name)
        results: list[tuple[str, Any]] = []
        for impl in caller.get_hookimpls():
            try:
                results.append((impl.plugin_name, impl.function(**kwargs)))
            except Exception as exc:
                self._drop(impl.plugin_name, f"hook {hook_name}", exc)
        return results

    def _drop(self, plugin_name: str, stage: str, exc: BaseException) -> None:
        record = self.records.setdefault(
            plugin_name, PluginRecord(plugin_name, plugin_name, None, None)
        )
        record.fail(stage, exc)
        plugin = self.manager.get_plugin(plugin_name)
        if plugin is not None:
            self.manager.unregister(plugin)
        for name in [n for n, e in self.backends.items() if e.plugin == plugin_name]:
            del self.backends[name]

    def collect_backends(self) -> None:
        """Ask every plugin for its backends (each one's availability is probed when asked)."""
        for plugin_name, result in self.call_isolated("lamina_register_backends"):
            try:
                for backend in _as_backends(result, plugin_name):
                    self._add_backend(backend, plugin_name)
            except TypeError as exc:
                self._drop(plugin_name, "hook lamina_register_backends", exc)

    def _add_backend(self, backend: Backend, plugin_name: str) -> None:
        if backend.name in self.backends:
            owner = self.backends[backend.name].plugin
            self._drop(
                plugin_name,
                "hook lamina_register_backends",
                ValueError(f"backend name {backend.name!r} is already provided by {owner!r}"),
            )
            return
        self.backends[backend.name] = BackendEntry(backend, plugin_name)
        self.records[plugin_name].backends.append(backend.name)

    # -- queries -----------------------------------------------------------------------
    def backend(self, name: str) -> Backend:
        """The backend called ``name``; error listing the installed ones if unknown."""
        entry = self.backends.get(name)
        if entry is None:
            installed = ", ".join(sorted(self.backends)) or "none"
            raise BackendNotFoundError(
                f"unknown backend {name!r}; installed backends: {installed} "
                f"(install lamina-backend-{name} or set {BACKEND_ENV} to one of those)"
            )
        return entry.backend

    def select_backend(self, requested: str | None = None) -> Backend:
        """The backend to use: ``requested``, else ``$LAMINA_BACKEND``, else the best available.

        A backend chosen by name must be available (error with its reason otherwise).
        """
        name = requested or os.environ.get(BACKEND_ENV) or None
        if name:
            backend = self.backend(name.strip())
            availability = self.backends[backend.name].availability
            if not availability.available:
                raise BackendUnavailableError(
                    f"backend {backend.name!r} is unavailable: {availability.reason}"
                )
            return backend
        ready = [e.backend for e in self.backends.values() if e.availability.available]
        if not ready:
            raise BackendUnavailableError(
                "no available lamina backend; install lamina-core (which ships 'cpu') "
                "and check `lamina info`"
            )
        return max(ready, key=lambda b: (b.priority, b.name == "cpu", b.name))

    def failures(self) -> list[PluginRecord]:
        """Plugins that failed to import, validate or run a hook."""
        return [r for r in self.records.values() if r.status == "failed"]


def _probe(backend: Backend) -> Availability:
    try:
        availability = backend.availability()
    except Exception as exc:
        return Availability.no(f"availability check raised {type(exc).__name__}: {exc}")
    if not isinstance(availability, Availability):
        return Availability.no(f"availability() returned {type(availability).__name__}")
    return availability


def _as_backends(result: object, plugin_name: str) -> Iterable[Backend]:
    items = result if isinstance(result, (list, tuple)) else [result]
    for item in items:
        if not isinstance(item, Backend):
            raise TypeError(
                f"plugin {plugin_name!r} returned {type(item).__name__} from "
                "lamina_register_backends; return lamina.device.backend.Backend instances"
            )
    return items  # type: ignore[return-value]


def _entry_points(group: str) -> list[md.EntryPoint]:
    seen: dict[tuple[str, str], md.EntryPoint] = {}
    for ep in md.entry_points(group=group):
        seen.setdefault((ep.name, ep.value), ep)
    return list(seen.values())


def load_plugins(
    group: str = hookspecs.PROJECT,
    extra: Iterable[tuple[str, object]] = (),
) -> PluginRegistry:
    """Load every plugin of the entry-point ``group`` (plus ``extra`` (name, plugin) pairs).

    Never raises because of a plugin: failures are kept in :attr:`PluginRegistry.records`.
    """
    registry = PluginRegistry()
    for ep in _entry_points(group):
        dist = getattr(ep, "dist", None)
        record = PluginRecord(
            ep.name,
            ep.value,
            dist.metadata["Name"] if dist is not None else None,
            dist.version if dist is not None else None,
        )
        loaded = _import_isolated(ep.load, record)
        if loaded is not None:
            registry.add(loaded, record)
        else:
            registry.records[record.name] = record
    for name, plugin in extra:
        registry.add(plugin, PluginRecord(name, repr(plugin), None, None))
    registry.collect_backends()
    registry.call_isolated("lamina_register_kernels", registry=registry.kernels)
    return registry


def _import_isolated(load: Callable[[], Any], record: PluginRecord) -> Any:
    try:
        return load()
    except (Exception, SystemExit) as exc:
        record.fail("import", exc)
        return None


_REGISTRY: PluginRegistry | None = None


def get_registry(reload: bool = False) -> PluginRegistry:
    """The process-wide plugin registry, loaded on first use."""
    global _REGISTRY
    if _REGISTRY is None or reload:
        _REGISTRY = load_plugins()
    return _REGISTRY


__all__ = [
    "BACKEND_ENV",
    "BackendEntry",
    "PluginRecord",
    "PluginRegistry",
    "get_registry",
    "load_plugins",
]
