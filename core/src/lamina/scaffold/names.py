"""Every name of a new backend package, derived from its backend name."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from lamina.errors import ConfigError

__all__ = ["RESERVED_NAMES", "BackendNames", "backend_names"]

_NAME = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")

#: Names a new backend may not take, and who holds them.
RESERVED_NAMES: Mapping[str, str] = {
    "cpu": "lamina-core's own backend",
    "cuda": "lamina's backend lamina-backend-cuda",
    "xla": "lamina's backend lamina-backend-xla",
    "npu": "lamina's backend lamina-backend-npu",
    "reference": "the kernel registry, for reference implementations",
}


@dataclass(frozen=True)
class BackendNames:
    """The names of one backend package; ``name`` is the backend and entry-point name."""

    name: str

    @property
    def package(self) -> str:
        """The import package: ``lamina_<name>``."""
        return f"lamina_{self.name}"

    @property
    def distribution(self) -> str:
        """The distribution, as lamina's errors tell users to install it."""
        return f"lamina-backend-{self.name}"

    @property
    def class_prefix(self) -> str:
        """``my_device`` -> ``MyDevice`` (as in ``MyDeviceBackend``)."""
        return "".join(part.capitalize() for part in self.name.split("_"))

    def placeholders(self) -> dict[str, str]:
        """What each template placeholder becomes (in file contents and paths)."""
        return {"{{name}}": self.name, "{{Name}}": self.class_prefix}


def backend_names(name: str, installed: Mapping[str, str | None] | None = None) -> BackendNames:
    """Validate ``name`` for a new backend; ``installed`` maps the backends installed here to
    their distributions (one from ``lamina-backend-<name>`` itself may be generated again).

    Raises :class:`~lamina.errors.ConfigError` with a one-line reason and the fix.
    """
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"{name!r} is not a valid backend name; use lowercase letters, digits and single "
            "underscores, starting with a letter (e.g. 'mydevice')"
        )
    if name in RESERVED_NAMES:
        raise ConfigError(
            f"backend name {name!r} is taken by {RESERVED_NAMES[name]}; choose another name"
        )
    names = BackendNames(name)
    if installed and name in installed and installed[name] != names.distribution:
        owner = installed[name] or "a plugin without a distribution"
        raise ConfigError(
            f"backend name {name!r} is taken by {owner}, installed here; choose another name"
        )
    return names
