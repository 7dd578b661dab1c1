"""Every error lamina raises on purpose: one line that names the thing and the fix."""

from __future__ import annotations


class LaminaError(Exception):
    """Base class of lamina's own errors."""


class ConfigError(LaminaError, ValueError):
    """A setting, environment variable or argument has a value lamina cannot use."""


class BackendNotFoundError(ConfigError):
    """The requested backend name is not installed."""


class BackendUnavailableError(LaminaError, RuntimeError):
    """The backend is installed but cannot run here (no device, no driver, no toolkit)."""


class NotSupportedError(LaminaError, RuntimeError):
    """The device has no such capability (e.g. streams on XLA); the message says why."""


class TopologyError(LaminaError, ValueError):
    """A topology file or object is invalid; the message names the file and field."""


class MeshError(ConfigError):
    """A device mesh cannot be formed from the given shape or topology."""


class KernelError(LaminaError, LookupError):
    """A kernel name or kernel implementation is unknown, or its arguments are wrong."""


class VerificationError(LaminaError, RuntimeError):
    """Ranks of one job disagree on what they are about to run (or one never arrived); the
    message names the ranks and the first difference."""


#: Longest reason :func:`failure_reason` returns.
_REASON_CHARS = 300


def failure_reason(exc: BaseException) -> str:
    """``ExceptionType: first non-empty line of its message`` (shortened to one line), for
    the reasons fallbacks record."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."
