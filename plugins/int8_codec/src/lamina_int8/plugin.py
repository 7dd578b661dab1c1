"""The plugin module lamina finds through the ``lamina`` entry point: it registers the
int8 codec (``codec="int8"``)."""

from __future__ import annotations

from lamina.comm.codecs import Codec
from lamina.hookspecs import hookimpl
from lamina_int8.codec import Int8Codec


@hookimpl
def lamina_register_codecs() -> list[Codec]:
    """The int8 codec with its defaults (128-element blocks, error feedback)."""
    return [Int8Codec()]
