"""DeviceHandle for Ascend NPUs on ``torch.npu`` (registered by torch_npu).

Device index and count, synchronization and the caching allocator's counters go through
``torch.accelerator`` where the installed torch serves ``npu`` with it
(:class:`~lamina.device.accelerator.AcceleratorHandle`), else through ``torch.npu``;
streams and events are ``torch.npu.Stream`` / ``torch.npu.Event`` (ACL streams and
events), generators torch_npu's per-device ones. Only constructed after
:meth:`NpuBackend.availability` has imported torch_npu successfully.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import Any

import torch

from lamina.device.accelerator import AcceleratorHandle
from lamina.device.handle import Event, Stream
from lamina.device.torch_streams import TorchEvent, TorchStream

__all__ = ["FP8_MIN_SOC_VERSION", "NpuEvent", "NpuHandle", "NpuStream", "npu_runtime"]

#: First SoC with FP8 compute: Ascend950 (torch_npu's ``SocVersion`` enum, NpuVariables.h).
#: Ascend910 / 910B / 910_93 have no FP8 units; fp8 is reported only from this SoC on.
FP8_MIN_SOC_VERSION = 260


def npu_runtime() -> Any:
    """``torch.npu`` after importing torch_npu (which registers it on torch)."""
    importlib.import_module("torch_npu")
    return torch.npu  # type: ignore[attr-defined]


def _index(device: torch.device | int | None) -> int | None:
    if device is None or isinstance(device, int):
        return device
    if device.type != "npu":
        raise ValueError(f"the npu backend handles 'npu' devices, not {device!r}")
    return device.index


class NpuEvent(TorchEvent):
    """A ``torch.npu.Event`` (an ACL event; timing when created with ``enable_timing``)."""


class NpuStream(TorchStream):
    """A ``torch.npu.Stream`` (an ACL stream on one device)."""

    event_class = NpuEvent

    def new_event(self) -> NpuEvent:
        """A new timing ``torch.npu.Event``."""
        return NpuEvent(npu_runtime().Event(enable_timing=True))


NpuEvent.stream_class = NpuStream


class NpuHandle(AcceleratorHandle):
    """Ascend NPUs of this process: device, synchronization and memory figures through
    ``torch.accelerator`` where the installed torch serves ``npu`` with it (``torch.npu``
    otherwise), ``torch.npu`` streams and events; collectives over HCCL."""

    device_type = "npu"
    collective_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self) -> None:
        self._npu = npu_runtime()

    def graph_capture_reason(self) -> str:
        """lamina does not capture NPU graphs (the toolkit's graph mode is torchair's)."""
        return (
            "lamina does not capture npu graphs (the CANN graph mode is torchair's backend, "
            "not wired in); the step launches op by op"
        )

    def vendor(self) -> Any:
        """``torch.npu``."""
        return self._npu

    def new_stream(self, device: torch.device | None = None) -> Stream:
        return NpuStream(self._npu.Stream(device=_index(device)))

    def current_stream(self, device: torch.device | None = None) -> Stream:
        return NpuStream(self._npu.current_stream(_index(device)))

    def use_stream(self, stream: Stream) -> AbstractContextManager[None]:
        if not isinstance(stream, NpuStream):
            raise TypeError(f"the npu backend needs an NpuStream, got {type(stream).__name__}")
        context: AbstractContextManager[None] = self._npu.stream(stream.raw)
        return context

    def new_event(self, enable_timing: bool = True) -> Event:
        return NpuEvent(self._npu.Event(enable_timing=enable_timing), enable_timing)

    def manual_seed(self, seed: int) -> None:
        """Seed the generators of every visible NPU (``torch.npu.manual_seed_all``)."""
        self._npu.manual_seed_all(seed)

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        index = _index(device)
        state: torch.Tensor = self._npu.get_rng_state("npu" if index is None else index)
        return state

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        index = _index(device)
        self._npu.set_rng_state(state, "npu" if index is None else index)

    def soc_version(self) -> int:
        """torch_npu's SoC code (e.g. 220 = Ascend910B1, 260 = Ascend950; -1 unknown)."""
        getter = getattr(self._npu, "get_soc_version", None) or self._npu.utils.get_soc_version
        return int(getter())

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """fp16 always; bf16 where torch_npu reports it; fp8 only from Ascend950 on.

        Conservative on purpose: Ascend910 (first generation) and the 310 series have no
        bf16, and no SoC before Ascend950 has FP8 arithmetic (910B/910_93 compute in
        fp16/bf16/int8), so fp8 is not claimed there even though the tensors can be stored.
        """
        dtypes = {torch.float16}
        if bool(self._npu.is_bf16_supported()):
            dtypes.add(torch.bfloat16)
        if self.soc_version() >= FP8_MIN_SOC_VERSION:
            for name in ("float8_e4m3fn", "float8_e5m2"):
                dtype = getattr(torch, name, None)
                if isinstance(dtype, torch.dtype):
                    dtypes.add(dtype)
        return frozenset(dtypes)
