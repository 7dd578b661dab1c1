"""Reading lamina's numeric environment variables, with one-line errors that name them."""

from __future__ import annotations

import math
import os

from lamina.errors import ConfigError


def positive_seconds(name: str, *, example: float) -> float | None:
    """``$name`` as a positive, finite number of seconds; None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(
            f"{name}={raw!r} must be a positive number of seconds; set it to e.g. {example:g}"
        )
    return value
