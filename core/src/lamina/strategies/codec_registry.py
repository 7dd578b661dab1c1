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
        known = plugins.collect_named(
            "lamina_register_codecs", Codec, dict(BUILTIN_CODECS), "codec"
        )
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
