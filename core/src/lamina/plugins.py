"""Plugin loading: entry-point discovery, isolation of broken plugins, backend selection."""

from __future__ import annotations

import importlib.metadata as md
import os
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import pluggy

from lamina import hookspecs
from lamina.device.backend import Availability, Backend
from lamina.device.kernels import KernelRegistry, builtin_registry
from lamina.device.topology import HostTopology
from lamina.envvars import BACKEND_ENV
from lamina.errors import BackendNotFoundError, BackendUnavailableError

#: A plugin-registered item (a strategy, a codec).
T = TypeVar("T")

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
            _reject_wrappers(self.manager, plugin)
        except Exception as exc:
            record.fail("validation", exc)
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)

    def call_isolated(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call ``hook_name`` as pluggy would, but one implementation at a time.

        The order is pluggy's (``tryfirst`` ones, then the rest with the last registered
        first, then ``trylast`` ones) and each implementation goes through pluggy's own
        call machinery, so it receives only the arguments it declares. ``None`` is no
        answer; for a ``firstresult`` hook the first other answer ends the call. A plugin
        whose implementation raises is marked failed at ``hook <name>`` and unregistered,
        and the next implementation is asked as if it had answered ``None``.

        Returns ``(plugin name, answer)`` pairs in call order (at most one for a
        ``firstresult`` hook).
        """
        caller: pluggy.HookCaller = getattr(self.manager.hook, hook_name)
        first = bool(caller.spec is not None and caller.spec.opts.get("firstresult"))
        answers: list[tuple[str, Any]] = []
        # pluggy's _multicall stops at the first exception, so isolation needs one call per
        # implementation: a subset caller holding only that plugin, in pluggy's order.
        for impl in reversed(caller.get_hookimpls()):
            others = [p for p in self.manager.get_plugins() if p is not impl.plugin]
            only_this = self.manager.subset_hook_caller(hook_name, remove_plugins=others)
            try:
                result = only_this(**kwargs)
            except Exception as exc:
                self._drop(impl.plugin_name, f"hook {hook_name}", exc)
                continue
            answer = result if first else next(iter(result), None)
            if answer is not None:
                answers.append((impl.plugin_name, answer))
                if first:
                    break
        return answers

    def discover_host(
        self, backend: Backend, local_rank: int, local_world_size: int
    ) -> HostTopology:
        """This host as ``lamina.init()`` sees it: the first plugin that describes it
        (``lamina_discover_topology``), else ``backend.discover_host_topology``.

        A plugin answering something other than a ``HostTopology`` is marked failed and
        the remaining plugins are asked again.
        """
        hook = "lamina_discover_topology"
        while answers := self.call_isolated(
            hook, backend=backend, local_rank=local_rank, local_world_size=local_world_size
        ):
            plugin_name, answer = answers[0]
            if isinstance(answer, HostTopology):
                return answer
            self.fail_plugin(
                plugin_name,
                f"hook {hook}",
                f"returned {type(answer).__name__} from {hook}; "
                "return a lamina.device.topology.HostTopology or None",
            )
        return backend.discover_host_topology(local_rank, local_world_size)

    def collect_named(
        self, hook_name: str, item_type: type[object], known: dict[str, T], noun: str
    ) -> dict[str, T]:
        """``known`` plus every plugin's answer to ``hook_name`` (a list of ``item_type``
        with a ``name`` each), by name. A plugin answering something else, or reusing a
        name, fails at ``hook <hook_name>`` and adds nothing; the others stay."""
        for plugin, result in self.call_isolated(hook_name):
            items = result if isinstance(result, (list, tuple)) else [result]
            bad = next((i for i in items if not isinstance(i, item_type)), None)
            taken = next((i.name for i in items if getattr(i, "name", None) in known), None)
            if bad is not None or taken is not None:
                why = (
                    f"returned {type(bad).__name__}, not a lamina {item_type.__name__}"
                    if bad is not None
                    else f"{noun} name {taken!r} is already registered"
                )
                self.fail_plugin(plugin, f"hook {hook_name}", why)
                continue
            known.update({i.name: i for i in items})
        return known

    def fail_plugin(self, plugin_name: str, stage: str, message: str) -> None:
        """Record ``plugin_name`` as failed at ``stage`` (e.g. a hook's answer was invalid)
        and unregister it, with everything it registered."""
        self._drop(plugin_name, stage, TypeError(message))

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
        """Ask every plugin for its backends (each one's availability is probed when asked).

        Names are settled in load order, not call order: of two plugins registering one
        name, the one loaded first keeps it, whatever ``tryfirst`` says.
        """
        answers = self.call_isolated("lamina_register_backends")
        load_order = list(self.records)
        answers.sort(key=lambda pair: load_order.index(pair[0]))
        for plugin_name, result in answers:
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


def _reject_wrappers(manager: pluggy.PluginManager, plugin: object) -> None:
    """lamina calls each implementation on its own, so a wrapper would wrap nothing."""
    for caller in manager.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper):
                raise TypeError(
                    f"{caller.name} is declared as a hook wrapper, which lamina does not "
                    "support (each implementation is called on its own); drop wrapper=True"
                )


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
