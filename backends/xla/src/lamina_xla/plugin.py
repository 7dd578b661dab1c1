"""The lamina plugin of the XLA backend (entry point ``lamina: xla``).

Kernels: none registered; the built-in kernels' pure-torch references trace into the
XLA graph like any other torch code, which is what an XLA implementation would do.
"""

from __future__ import annotations

from lamina.device.backend import Backend
from lamina.hookspecs import hookimpl
from lamina_xla.backend import XlaBackend


@hookimpl
def lamina_register_backends() -> list[Backend]:
    """The XLA backend (cheap to construct: torch_xla is imported only when probed)."""
    return [XlaBackend()]
