"""Whether torch_xla can run here, decided before anything starts the PJRT runtime.

Order of the checks, each failing with a reason that names the fix:

1. ``torch_xla`` is found by ``importlib.util.find_spec`` (nothing imported yet);
2. its release matches torch's (a torch_xla release is built against one torch release);
3. the PJRT device type: ``PJRT_DEVICE`` when set. When it is not set, importing
   torch_xla 2.9 picks one itself (``TPU`` when libtpu and a TPU chip are found,
   ``NEURON`` when libneuronpjrt is found, else ``CPU`` with a logged warning) and writes
   it to ``PJRT_DEVICE``. lamina accepts the accelerator it found but not the silent
   ``CPU`` fallback: XLA on the host CPU is a testing setup and must be asked for;
4. for ``TPU``: libtpu is loadable and a TPU chip is attached.

The runtime itself is not started here: on a multi-process TPU job it must be
configured for this process's chips before it starts, which only ``lamina.init`` knows.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass

from lamina.versions import package_version

#: Environment variable naming the PJRT device type (``TPU``, ``CPU``, ``CUDA``, ...).
PJRT_DEVICE_ENV = "PJRT_DEVICE"
#: torch_xla skips choosing a default PJRT device when this is ``"0"``.
SELECT_DEFAULT_ENV = "PJRT_SELECT_DEFAULT_DEVICE"

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version such as ``"2.9.0+cu128"``; None if unparsable."""
    match = _RELEASE.match(version.strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def release_text(version: str) -> str:
    """The public release part of ``version`` (``"2.9.0+cu128"`` -> ``"2.9.0"``)."""
    parts = release(version)
    return ".".join(map(str, parts)) if parts else version


def missing_reason(torch_version: str | None) -> str:
    """Why the backend is unavailable when torch_xla is not installed, with the pip line."""
    if torch_version is None:
        return "torch_xla is not installed; pip install torch==2.9.0 torch_xla==2.9.0"
    wanted = release_text(torch_version)
    return (
        f"torch_xla is not installed; pip install torch_xla=={wanted} "
        f"(a torch_xla release needs the torch release of the same number, torch "
        f"{torch_version} is installed)"
    )


def version_mismatch(torch_version: str | None, xla_version: str | None) -> str | None:
    """The reason torch_xla cannot load against this torch, or None when the releases pair."""
    if torch_version is None or xla_version is None:
        return None
    t, x = release(torch_version), release(xla_version)
    if t is None or x is None or t[:2] == x[:2]:
        return None
    return (
        f"torch_xla {xla_version} needs torch {x[0]}.{x[1]}.x but torch {torch_version} is "
        f"installed; pip install torch=={release_text(xla_version)} (or the torch_xla "
        f"release matching torch {release_text(torch_version)})"
    )


@dataclass(frozen=True)
class PjrtChoice:
    """The PJRT device type in force and whether the user (not torch_xla) chose it."""

    device_type: str | None
    explicit: bool


_AUTO_CHOICE: dict[str, str | None] = {}


def pjrt_choice() -> PjrtChoice:
    """Import torch_xla (lazily) and report the PJRT device type it will use.

    When ``PJRT_DEVICE`` was unset before the first import, the type torch_xla chose is
    remembered so that later probes in this process still know it was not the user's.
    """
    before = os.environ.get(PJRT_DEVICE_ENV, "").strip()
    first_import = "torch_xla" not in sys.modules
    import torch_xla.runtime as xr

    chosen = xr.device_type()
    if first_import and not before:
        _AUTO_CHOICE["device_type"] = chosen
    auto = "device_type" in _AUTO_CHOICE and _AUTO_CHOICE["device_type"] == chosen
    return PjrtChoice(chosen, explicit=bool(before) and not auto)


def unset_reason(choice: PjrtChoice) -> str | None:
    """Why a PJRT choice the user did not make is refused (None: it is accepted)."""
    if choice.explicit:
        return None
    if choice.device_type is None:
        return (
            f"{PJRT_DEVICE_ENV} is not set (and {SELECT_DEFAULT_ENV}=0 stops torch_xla from "
            f"choosing); set {PJRT_DEVICE_ENV}=TPU (or CPU for testing)"
        )
    if choice.device_type == "CPU":
        return (
            f"{PJRT_DEVICE_ENV} is not set and torch_xla found no TPU, so it would fall back "
            f"to the host CPU; set {PJRT_DEVICE_ENV}=TPU on a TPU host, or "
            f"{PJRT_DEVICE_ENV}=CPU to run XLA on the host CPU for testing"
        )
    return None


def tpu_reason() -> str | None:
    """Why PJRT_DEVICE=TPU cannot run here (libtpu or chips missing), or None."""
    import torch_xla
    from torch_xla._internal import tpu

    if not getattr(torch_xla, "_found_libtpu", True):
        version = release_text(package_version("torch_xla") or "2.9.0")
        return (
            f"{PJRT_DEVICE_ENV}=TPU but libtpu is not installed; "
            f'pip install "torch_xla[tpu]=={version}"'
        )
    chips = tpu.num_available_chips()
    if chips < 1:
        return (
            f"{PJRT_DEVICE_ENV}=TPU but no TPU chip is attached (no Google TPU PCI device "
            f"in /sys/bus/pci); run on a TPU VM, or set {PJRT_DEVICE_ENV}=CPU for testing"
        )
    return None


def tpu_chip_count() -> int:
    """TPU chips attached to this host through PCI (torch_xla's own count)."""
    from torch_xla._internal import tpu

    count: int = tpu.num_available_chips()
    return count


def find_torch_xla() -> bool:
    """True when the torch_xla package can be found (without importing it)."""
    return importlib.util.find_spec("torch_xla") is not None
