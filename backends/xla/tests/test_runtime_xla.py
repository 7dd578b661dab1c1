"""The XLA backend against the real torch_xla runtime (PJRT_DEVICE=CPU runs it here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lamina.device.backend import Backend
from lamina.device.handle import DeviceHandle
from lamina.errors import NotSupportedError
from lamina_xla import probe


def _pjrt() -> str:
    return os.environ.get(probe.PJRT_DEVICE_ENV, "")


@pytest.mark.skipif(not probe.find_torch_xla(), reason="torch_xla is not installed")
def test_unset_pjrt_device_is_explained() -> None:
    """torch_xla picks a device itself when PJRT_DEVICE is unset; lamina says what it did."""
    env = {k: v for k, v in os.environ.items() if k != probe.PJRT_DEVICE_ENV}
    code = (
        "from lamina.plugins import get_registry\n"
        "a = get_registry().backends['xla'].availability\n"
        "print(a.available, a.reason, sep='|')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    available, reason = out.stdout.strip().splitlines()[-1].split("|", 1)
    if available == "True":  # a TPU host: torch_xla chose TPU and lamina accepts it
        assert "chosen by torch_xla" in reason
    else:
        assert reason.startswith("PJRT_DEVICE is not set")


class TestXlaRuntime:
    backends = ("xla",)

    def test_handle_basics(self, lamina_handle: DeviceHandle) -> None:
        device = lamina_handle.current_device()
        assert device.type == "xla"
        lamina_handle.set_device(device)
        with pytest.raises(ValueError, match="does not exist"):
            lamina_handle.set_device(lamina_handle.device_count())
        with pytest.raises(ValueError, match="not 'cpu'"):
            lamina_handle.set_device(torch.device("cpu"))

    def test_rng_state_is_a_cpu_byte_tensor(self, lamina_handle: DeviceHandle) -> None:
        lamina_handle.manual_seed(7)
        state = lamina_handle.get_rng_state()
        assert state.device.type == "cpu" and state.dtype == torch.uint8
        assert state.numel() == 8

    def test_missing_capabilities_say_why(self, lamina_handle: DeviceHandle) -> None:
        for call in (
            lamina_handle.new_stream,
            lamina_handle.current_stream,
            lamina_handle.new_event,
            lamina_handle.reset_peak_memory,
        ):
            with pytest.raises(NotSupportedError, match="xla"):
                call()

    def test_dtypes(self, lamina_handle: DeviceHandle) -> None:
        dtypes = lamina_handle.supported_dtypes()
        assert {torch.bfloat16, torch.float16} <= dtypes
        assert lamina_handle.supported_dtypes() is dtypes  # probed once

    @pytest.mark.skipif(_pjrt() != "CPU", reason="checks PJRT CPU; PJRT_DEVICE is not CPU")
    def test_pjrt_cpu_specifics(self, lamina_backend: Backend, lamina_handle: DeviceHandle) -> None:
        stats = lamina_handle.memory_stats()
        assert (stats.allocated, stats.peak, stats.scope) == (None, None, "device")
        piece = lamina_backend.discover_host_topology(0, 1)
        assert piece.device_type == "xla" and piece.local_links == ()
        assert any("CPU device CPU:0" in note for note in piece.notes)
        with pytest.raises(NotSupportedError, match="one process only"):
            lamina_backend.prepare_process(0, 2, 0, 2)  # type: ignore[attr-defined]
        lamina_backend.prepare_process(0, 1, 0, 1)  # type: ignore[attr-defined]
