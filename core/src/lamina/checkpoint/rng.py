"""Every random stream of one rank, as a snapshot that ``torch.load(weights_only=True)``
reads back: torch's CPU generator, the device's (through the DeviceHandle), Python's
``random`` and NumPy's global generator when NumPy is loaded; and :func:`seed_all`, which
seeds every one of them, so that two runs with one seed save the same states."""

from __future__ import annotations

import importlib
import random
import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lamina.device.handle import DeviceHandle


def seed_all(
    seed: int, handle: DeviceHandle | None = None, device: torch.device | None = None
) -> None:
    """Seed every stream :func:`capture` records: torch's generators (``torch.manual_seed``
    seeds the CPU's and every device's), the device's through ``handle`` (a backend whose
    generator torch does not seed, such as XLA), Python's ``random`` and NumPy's global
    generator (NumPy is imported here when installed, so that it is not seeded from the
    OS's entropy when something imports it later)."""
    torch.manual_seed(seed)
    if handle is not None and device is not None and device.type != "cpu":
        handle.manual_seed(seed)
    random.seed(seed)
    try:
        numpy = importlib.import_module("numpy")
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def capture(
    handle: DeviceHandle | None = None, device: torch.device | None = None
) -> dict[str, Any]:
    """This rank's random states (tensors, ints and lists only)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
    }
    if handle is not None and device is not None and device.type != "cpu":
        state["device"] = handle.get_rng_state(device)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return state


def restore(
    state: dict[str, Any], handle: DeviceHandle | None = None, device: torch.device | None = None
) -> None:
    """Put back what :func:`capture` took."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "device" in state and handle is not None and device is not None and device.type != "cpu":
        handle.set_rng_state(state["device"], device)
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
