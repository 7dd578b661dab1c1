"""Byte sizes as lamina prints them, in one style everywhere: ``4 KiB``, ``1.5 MiB``."""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``4 KiB``, ``1.5 MiB``, ``64 GiB``.

    A whole number of the unit prints without decimals, anything else with one; the unit
    is the largest (up to TiB) that keeps the printed figure under 1024.
    """
    value = float(n)
    unit = _UNITS[0]
    for unit in _UNITS:
        if abs(round(value, 1)) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return f"{value:.0f} {unit}" if value.is_integer() else f"{value:.1f} {unit}"
