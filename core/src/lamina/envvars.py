"""Reading lamina's numeric environment variables, with one-line errors that name them."""

from __future__ import annotations

import math
import os

from lamina.errors import ConfigError

#: Environment variable that names the backend to use, overriding priorities.
BACKEND_ENV = "LAMINA_BACKEND"
#: Seconds the pre-flight check waits for every rank to arrive (``lamina verify --timeout``).
VERIFY_TIMEOUT_ENV = "LAMINA_VERIFY_TIMEOUT"


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
