"""Every token dispatcher lamina knows by name: the built-in ``all_to_all``, plus those
plugins register through ``lamina_register_dispatchers`` (see :mod:`lamina.hookspecs`).
A plugin dispatcher whose name is taken, or that is not a
:class:`~lamina.strategies.ep.dispatch.Dispatcher`, makes that plugin fail (recorded, as
for codecs) and leaves the others in place.
"""

from __future__ import annotations

import weakref

from lamina.errors import ConfigError
from lamina.plugins import PluginRegistry, get_registry
from lamina.strategies.ep.dispatch import AllToAllDispatcher, Dispatcher

_BY_REGISTRY: weakref.WeakKeyDictionary[PluginRegistry, dict[str, Dispatcher]] = (
    weakref.WeakKeyDictionary()
)


def dispatchers(plugins: PluginRegistry | None = None) -> dict[str, Dispatcher]:
    """Name -> dispatcher: the built-in, then every plugin's (collected once per registry)."""
    plugins = plugins or get_registry()
    known = _BY_REGISTRY.get(plugins)
    if known is None:
        builtin: dict[str, Dispatcher] = {AllToAllDispatcher.name: AllToAllDispatcher()}
        known = plugins.collect_named(
            "lamina_register_dispatchers", Dispatcher, builtin, "dispatcher"
        )
        _BY_REGISTRY[plugins] = known
    return known


def resolve_dispatcher(spec: str | Dispatcher, plugins: PluginRegistry | None = None) -> Dispatcher:
    """The dispatcher named ``spec`` (or ``spec`` itself); ConfigError listing the known
    names when unknown."""
    if isinstance(spec, Dispatcher):
        return spec
    known = dispatchers(plugins)
    if not isinstance(spec, str) or spec not in known:
        raise ConfigError(
            f"token dispatcher {spec!r} is unknown; use one of {', '.join(sorted(known))} or a "
            "Dispatcher instance (plugins add dispatchers through the "
            "lamina_register_dispatchers hook)"
        )
    return known[spec]


__all__ = ["dispatchers", "resolve_dispatcher"]
