"""The plugin module of backend "template": the target of the ``lamina`` entry point.

lamina imports this module and calls its ``@hookimpl`` functions. Keep it cheap: no
vendor import, no device probing; both belong in ``Backend.availability()``.

The third hook, ``lamina_discover_topology``, is not implemented: a backend describes
its own host in ``discover_host_topology``; the hook is for plugins that know a host
better than its backend (a site's cluster description, say).
"""

from __future__ import annotations

from lamina.device.backend import Backend
from lamina.device.kernels import KernelRegistry
from lamina.hookspecs import hookimpl
from lamina_template.backend import BACKEND_NAME, TemplateBackend
from lamina_template.kernels import register_template_kernels


@hookimpl
def lamina_register_backends() -> list[Backend]:
    """The template backend (until ported, a host-CPU stand-in for an accelerator)."""
    return [TemplateBackend()]


@hookimpl
def lamina_register_kernels(registry: KernelRegistry) -> None:
    """The template backend's kernel implementations."""
    register_template_kernels(registry, BACKEND_NAME)
