"""AcceleratorHandle: ``torch.accelerator`` where it serves the handle's device type, the
vendor module's functions of the same job where it does not (or where an older torch
lacks one of them). Both sides are faked at the boundary: a recording vendor module and
a recording ``torch.accelerator``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lamina.backends.cpu import CpuHandle
from lamina.device.accelerator import ACCELERATOR_NAMES, AcceleratorHandle

pytestmark = pytest.mark.portable


def _recorder(prefix: str, calls: list[str], names: list[str]) -> SimpleNamespace:
    """A namespace whose functions record ``prefix.name(args)`` and return 7."""

    def make(name: str) -> Any:
        def function(*args: Any) -> int:
            calls.append(f"{prefix}.{name}{args}")
            return 7

        return function

    return SimpleNamespace(**{name: make(name) for name in names})


class FakeAcceleratorHandle(AcceleratorHandle, CpuHandle):
    """The CPU handle's streams and generators; device calls through the routing."""

    def __init__(self, vendor: SimpleNamespace) -> None:
        super().__init__()
        self._vendor = vendor

    def vendor(self) -> Any:
        return self._vendor


def _accelerator(calls: list[str], serves: str, names: list[str]) -> SimpleNamespace:
    api = _recorder("acc", calls, names)
    api.is_available = lambda: True
    api.current_accelerator = lambda: torch.device(serves)
    return api


def _exercise(handle: AcceleratorHandle) -> None:
    assert handle.device_count() == 7
    assert handle.current_device() == torch.device("cpu", 7)
    handle.set_device(0)
    handle.synchronize()
    stats = handle.memory_stats()
    assert (stats.allocated, stats.reserved, stats.peak, stats.scope) == (7, 7, 7, "device")
    handle.reset_peak_memory()


def test_the_vendor_module_answers_without_torch_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch, "accelerator", SimpleNamespace(is_available=lambda: False))
    _exercise(FakeAcceleratorHandle(_recorder("vendor", calls, list(ACCELERATOR_NAMES.values()))))
    assert calls and all(c.startswith("vendor.") for c in calls)
    assert "vendor.set_device(0,)" in calls and "vendor.current_device()" in calls


def test_torch_accelerator_answers_for_its_own_device_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    vendor = _recorder("vendor", calls, list(ACCELERATOR_NAMES.values()))
    monkeypatch.setattr(torch, "accelerator", _accelerator(calls, "cpu", list(ACCELERATOR_NAMES)))
    _exercise(FakeAcceleratorHandle(vendor))
    assert calls and all(c.startswith("acc.") for c in calls), calls
    assert "acc.set_device_index(0,)" in calls and "acc.current_device_index()" in calls
    # another device type's accelerator is not asked
    calls.clear()
    monkeypatch.setattr(torch, "accelerator", _accelerator(calls, "cuda", list(ACCELERATOR_NAMES)))
    _exercise(FakeAcceleratorHandle(vendor))
    assert all(c.startswith("vendor.") for c in calls), calls


def test_what_an_older_torch_accelerator_lacks_comes_from_the_vendor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    vendor = _recorder("vendor", calls, list(ACCELERATOR_NAMES.values()))
    older = ["device_count", "current_device_index", "set_device_index", "synchronize"]
    monkeypatch.setattr(torch, "accelerator", _accelerator(calls, "cpu", older))
    _exercise(FakeAcceleratorHandle(vendor))
    assert "acc.device_count()" in calls and "vendor.memory_allocated(None,)" in calls
    with pytest.raises(ValueError, match="manages 'cpu' devices"):
        FakeAcceleratorHandle(vendor).set_device(torch.device("meta"))
