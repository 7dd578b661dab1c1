"""Every gradient codec lamina knows by name: the built-ins, plus those plugins register.

Plugins add codecs through the ``lamina_register_codecs`` hook (see
:mod:`lamina.hookspecs`). A plugin codec whose name is taken, or that is not a
:class:`~lamina.comm.codecs.Codec`, makes that plugin fail (recorded, as for backends and
strategies) and leaves the others in place.
"""

from __future__ import annotations

import weakref

from lamina.comm.codecs import BUILTIN_CODECS, Codec
from lamina.errors import ConfigError
from lamina.plugins import PluginRegistry, get_registry

_BY_REGISTRY: weakref.WeakKeyDictionary[PluginRegistry, dict[str, Codec]] = (
    weakref.WeakKeyDictionary()
)


def codecs(plugins: PluginRegistry | None = None) -> dict[str, Codec]:
    """Name -> codec: the built-ins, then every plugin's (collected once per registry)."""
    plugins = plugins or get_registry()
    known = _BY_REGISTRY.get(plugins)
    if known is None:
        known = dict(BUILTIN_CODECS)
        for plugin, result in plugins.call_isolated("lamina_register_codecs"):
            items = result if isinstance(result, (list, tuple)) else [result]
            bad = next((i for i in items if not isinstance(i, Codec)), None)
            taken = next((i.name for i in items if getattr(i, "name", None) in known), None)
            if bad is not None or taken is not None:
                why = (
                    f"returned {type(bad).__name__}, not a lamina Codec"
                    if bad is not None
                    else f"codec name {taken!r} is already registered"
                )
                plugins.fail_plugin(plugin, "hook lamina_register_codecs", why)
                continue
            known.update({c.name: c for c in items})
        _BY_REGISTRY[plugins] = known
    return known


def resolve_codec(spec: str | Codec | None, plugins: PluginRegistry | None = None) -> Codec | None:
    """The codec named ``spec`` (or ``spec`` itself, or None); ConfigError listing the known
    names when unknown."""
    if spec is None or isinstance(spec, Codec):
        return spec
    known = codecs(plugins)
    if not isinstance(spec, str) or spec not in known:
        raise ConfigError(
            f"codec {spec!r} is unknown; use one of {', '.join(sorted(known))}, a Codec "
            "instance or None (plugins add codecs through the lamina_register_codecs hook)"
        )
    return known[spec]
