"""Every hook a lamina plugin can implement. This file is the extension surface.

A plugin is a module (or object) exposed through the ``lamina`` entry-point group::

    [project.entry-points.lamina]
    mydevice = "lamina_mydevice.plugin"

whose functions are decorated with :data:`hookimpl` and named after the specs below.
lamina loads each plugin in isolation: a plugin that raises on import, fails hook
validation, or raises inside a hook is recorded with its error (``lamina info`` shows it)
and unregistered, and every other plugin goes on working.

Calls follow pluggy's rules. An implementation declares only the arguments it uses
(``def lamina_discover_topology(local_rank)`` is valid) and receives just those.
Implementations run in pluggy's order: those marked ``@hookimpl(tryfirst=True)`` first,
then the others with the plugin registered last first, then ``trylast`` ones. ``None``
is no answer; for a ``firstresult`` hook the first other answer is the result. Each
implementation is called on its own, so one that raises fails only its plugin and the
next one is asked; hook wrappers (``wrapper=True``) are therefore not supported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from lamina.comm.codecs import Codec
    from lamina.device.backend import Backend
    from lamina.device.kernels import KernelRegistry
    from lamina.device.topology import HostTopology
    from lamina.strategies.contract import Strategy
    from lamina.strategies.ep.dispatch import Dispatcher

#: The pluggy project name; also the entry-point group plugins are found in.
PROJECT = "lamina"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Decorate a plugin's hook functions with this.
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def lamina_register_backends() -> list[Backend]:
    """Return the device backends this plugin provides (may be empty).

    Called once when plugins are loaded. Each item must be a
    :class:`lamina.device.backend.Backend` with a unique ``name``; construction must be
    cheap and must not import the vendor runtime (do that in ``availability()``).
    A name already registered by another plugin is recorded as a conflict and ignored.
    """


@hookspec
def lamina_register_kernels(registry: KernelRegistry) -> None:
    """Add kernel implementations to ``registry``.

    Called once after backends are registered, with the registry that already holds
    the built-in kernel specs and their pure-torch references. Call
    ``registry.register(kernel_name, backend_name, fn)`` for each kernel the plugin
    accelerates; ``fn`` is called as ``fn(config, *args, **kwargs)`` with a
    :class:`lamina.device.kernels.LaunchConfig`. A plugin may also ``registry.define``
    new kernels (with a reference implementation).
    """


@hookspec(firstresult=True)
def lamina_discover_topology(
    backend: Backend, local_rank: int, local_world_size: int
) -> HostTopology | None:
    """Describe this host for ``backend`` instead of the backend's own discovery.

    Called once per process by ``lamina.init()`` before the per-rank pieces are merged
    into the global topology. Return ``None`` to leave it to the next plugin and
    finally to ``backend.discover_host_topology``. The first non-``None`` answer wins.
    A topology file named by ``LAMINA_TOPOLOGY`` takes precedence over every answer.
    """


@hookspec
def lamina_register_strategies() -> list[Strategy]:
    """Return the parallel strategies this plugin provides (may be empty).

    Called once, the first time a strategy is looked up (``lamina.distribute``). Each
    item must be a :class:`lamina.strategies.contract.Strategy` with a name no other
    strategy has (dp, zero3, hsdp, tp and pp are built in); ``lamina.distribute(model, name,
    **options)`` then validates ``options`` against its options dataclass, places it on
    the runtime's mesh and calls its ``wrap``. A plugin whose answer is not a list of
    strategies, or reuses a name, is recorded as failed and its strategies are ignored.
    """


@hookspec
def lamina_register_codecs() -> list[Codec]:
    """Return the gradient codecs this plugin provides (may be empty).

    Called once, the first time a codec is looked up by name (``distribute(model,
    strategy, codec=NAME)``). Each item must be a :class:`lamina.comm.codecs.Codec` with a
    name no other codec has (bf16, fp16 and fp8 are built in). A plugin whose answer is not
    a list of codecs, or reuses a name, is recorded as failed and its codecs are ignored.
    """


@hookspec
def lamina_register_dispatchers() -> list[Dispatcher]:
    """Return the MoE token dispatchers this plugin provides (may be empty).

    Called once, the first time a dispatcher is looked up by name. Each item must be a
    :class:`lamina.strategies.ep.dispatch.Dispatcher` with a name no other dispatcher has
    (``all_to_all`` is built in); :func:`lamina.testing.dispatchers.check_dispatcher`
    checks one against the whole layer in one process. A plugin whose answer is not a
    list of dispatchers, or reuses a name, is recorded as failed and its dispatchers are
    ignored.
    """
