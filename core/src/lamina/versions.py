"""Installed package versions, read from metadata without importing the package."""

from __future__ import annotations

import importlib.metadata as md

__all__ = ["package_version"]


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name``; ``None`` when not installed."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
