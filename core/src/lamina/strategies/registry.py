"""Every strategy lamina knows: the built-ins, plus those plugins register.

Plugins add strategies through the ``lamina_register_strategies`` hook (see
:mod:`lamina.hookspecs`). A plugin strategy whose name is taken, or that is not a
:class:`~lamina.strategies.contract.Strategy`, makes that plugin fail (recorded, as for
backends) and leaves the others in place.
"""

from __future__ import annotations

import weakref

from lamina.errors import ConfigError
from lamina.plugins import PluginRegistry, get_registry
from lamina.strategies.contract import Strategy


def builtin_strategies() -> list[Strategy]:
    """dp, zero3, hsdp, tp, pp, cp and ep (imported here, on first use, not when lamina
    is imported)."""
    from lamina.strategies.cp import ContextParallelStrategy
    from lamina.strategies.dp import DataParallelStrategy
    from lamina.strategies.ep import ExpertParallelStrategy
    from lamina.strategies.hsdp import HybridShardedStrategy
    from lamina.strategies.pp import PipelineStrategy
    from lamina.strategies.tp import TensorParallelStrategy
    from lamina.strategies.zero3 import Zero3Strategy

    return [
        DataParallelStrategy(),
        Zero3Strategy(),
        HybridShardedStrategy(),
        TensorParallelStrategy(),
        PipelineStrategy(),
        ContextParallelStrategy(),
        ExpertParallelStrategy(),
    ]


_BY_REGISTRY: weakref.WeakKeyDictionary[PluginRegistry, dict[str, Strategy]] = (
    weakref.WeakKeyDictionary()
)


def strategies(plugins: PluginRegistry | None = None) -> dict[str, Strategy]:
    """Name -> strategy: the built-ins, then every plugin's (collected once per registry)."""
    plugins = plugins or get_registry()
    known = _BY_REGISTRY.get(plugins)
    if known is None:
        known = plugins.collect_named(
            "lamina_register_strategies",
            Strategy,
            {s.name: s for s in builtin_strategies()},
            "strategy",
        )
        _BY_REGISTRY[plugins] = known
    return known


def get_strategy(name: str, plugins: PluginRegistry | None = None) -> Strategy:
    """The strategy called ``name``; ConfigError listing the known ones otherwise."""
    known = strategies(plugins)
    if not isinstance(name, str) or name not in known:
        raise ConfigError(
            f"unknown strategy {name!r}; choose one of {', '.join(known)} (plugins add more "
            "through the lamina_register_strategies hook)"
        )
    return known[name]
