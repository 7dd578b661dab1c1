"""XlaHandle: the DeviceHandle contract on torch_xla's lazy tensors and the PJRT runtime.

What XLA is, stated plainly:

* work is traced into a lazy graph and runs when the graph is cut (``torch_xla.sync()``)
  or a value is read; ``synchronize`` cuts the graph and waits for the device;
* there are no user streams or events: the graph orders device work, so
  ``new_stream``/``current_stream``/``new_event`` raise :class:`NotSupportedError`;
* memory figures come from the PJRT allocator (``xm.get_memory_info``) where the
  runtime has one (TPU); PJRT CPU has none, so every figure is ``None``. No torch_xla
  call resets the peak, so ``reset_peak_memory`` raises :class:`NotSupportedError`;
* the RNG state is one 64-bit seed per device (``xm.get_rng_state``); the handle hands it
  out as 8 little-endian bytes in a CPU ``uint8`` tensor, as the contract asks.

torch_xla is imported inside the methods, never at module import.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from lamina.device.handle import (
    REDUCED_PRECISION_DTYPES,
    DeviceHandle,
    Event,
    MemoryStats,
    Stream,
    torch_dtypes_by_name,
)
from lamina.errors import NotSupportedError

#: Bytes of the RNG state tensor: torch_xla keeps one unsigned 64-bit seed per device.
RNG_STATE_BYTES = 8

#: Environment variable restricting visible devices, per PJRT device type.
VISIBLE_DEVICES_ENV: dict[str, str] = {
    "TPU": "TPU_VISIBLE_CHIPS",
    "CUDA": "CUDA_VISIBLE_DEVICES",
    "NEURON": "NEURON_RT_VISIBLE_CORES",
}

_NO_STREAMS = (
    "xla has no user streams: torch_xla traces work into a lazy graph that orders it; "
    "call handle.synchronize() to run and wait for queued work"
)
_NO_EVENTS = (
    "xla has no device events: torch_xla traces work into a lazy graph; time a step with "
    "handle.synchronize() and a host clock"
)


def _xla() -> tuple[Any, Any]:
    """The torch_xla package and its ``xla_model`` module (imported on first use)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    return torch_xla, xm


def encode_rng_state(seed: int) -> torch.Tensor:
    """The 64-bit XLA seed as a CPU ``uint8`` tensor of 8 little-endian bytes."""
    if not 0 <= seed < 2 ** (8 * RNG_STATE_BYTES):
        raise ValueError(f"XLA RNG seed {seed} is outside the unsigned 64-bit range")
    return torch.tensor(list(seed.to_bytes(RNG_STATE_BYTES, "little")), dtype=torch.uint8)


def decode_rng_state(state: torch.Tensor) -> int:
    """The seed held by a tensor from :func:`encode_rng_state`; ValueError if malformed."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        kind = state.dtype if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(f"XLA RNG state must be a uint8 tensor from get_rng_state(), got {kind}")
    if state.numel() != RNG_STATE_BYTES:
        raise ValueError(
            f"XLA RNG state must hold {RNG_STATE_BYTES} bytes, got {state.numel()}; "
            "pass a tensor returned by get_rng_state()"
        )
    data = bytes(int(b) for b in state.detach().cpu().reshape(-1).tolist())
    return int.from_bytes(data, "little")


def memory_stats_from_info(info: dict[str, Any] | None) -> MemoryStats:
    """MemoryStats from a ``get_memory_info`` answer (None: the runtime gives no figures).

    ``bytes_used`` is live device memory; PJRT reports no allocator reserve (its
    ``bytes_limit`` is capacity, not memory held), so ``reserved`` is ``None``.
    """
    if info is None:
        return MemoryStats(None, None, None, "device")
    used, peak = info.get("bytes_used"), info.get("peak_bytes_used")
    return MemoryStats(
        int(used) if used is not None else None,
        None,
        int(peak) if peak is not None else None,
        "device",
    )


class XlaHandle(DeviceHandle):
    """DeviceHandle for the XLA devices this process addresses through PJRT."""

    device_type = "xla"
    collective_backend = "xla"

    def __init__(self, pjrt_device_type: str | None = None) -> None:
        self.pjrt_device_type = pjrt_device_type
        self.visible_devices_env = VISIBLE_DEVICES_ENV.get(pjrt_device_type or "")
        self._dtypes: frozenset[torch.dtype] | None = None

    def graph_capture_reason(self) -> str:
        """XLA needs no capture: it traces each step lazily and compiles it as one graph."""
        return (
            "xla traces each step into one graph and compiles it (torch_xla's lazy tensors); "
            "there is no separate capture to replay"
        )

    # -- devices -----------------------------------------------------------------------
    def device_count(self) -> int:
        """Devices this process addresses (starts the PJRT runtime on first call)."""
        torch_xla, _ = _xla()
        count: int = torch_xla.device_count()
        return count

    def current_device(self) -> torch.device:
        torch_xla, _ = _xla()
        device: torch.device = torch_xla.device()
        return device

    def _resolve(self, device: torch.device | int | str | None) -> torch.device:
        if device is None:
            return self.current_device()
        resolved = torch.device(self.device_type, device) if isinstance(device, int) else None
        resolved = resolved or torch.device(device)
        if resolved.type != self.device_type:
            raise ValueError(f"the xla backend has devices 'xla:N', not {str(device)!r}")
        index = 0 if resolved.index is None else resolved.index
        count = self.device_count()
        if not 0 <= index < count:
            raise ValueError(
                f"device xla:{index} does not exist; this process addresses {count} XLA "
                f"device(s) xla:0..xla:{count - 1}"
            )
        return torch.device(self.device_type, index)

    def set_device(self, device: torch.device | int) -> None:
        """Make ``device`` the default XLA device of this process.

        torch_xla has no public setter; this is the call its own thread-per-device
        launcher makes (``torch_xla._XLAC._xla_set_default_device``).
        """
        torch_xla, _ = _xla()
        target = self._resolve(device)
        if target != self.current_device():
            torch_xla._XLAC._xla_set_default_device(str(target))

    def real_device(self, device: torch.device | None = None) -> str:
        """The PJRT device behind ``device`` (e.g. ``"TPU:3"`` or ``"CPU:0"``)."""
        _, xm = _xla()
        name: str = xm.xla_real_devices([self._resolve(device)])[0]
        return name

    # -- memory --------------------------------------------------------------------------
    def memory_stats(self, device: torch.device | None = None) -> MemoryStats:
        """PJRT allocator figures of materialized tensors (run ``synchronize`` first).

        All fields are ``None`` where the runtime keeps no allocator statistics (PJRT CPU).
        """
        _, xm = _xla()
        target = self._resolve(device)
        try:
            info = dict(xm.get_memory_info(target))
        except RuntimeError as exc:
            if "UNIMPLEMENTED" not in str(exc) and "not supported" not in str(exc):
                raise
            return memory_stats_from_info(None)
        return memory_stats_from_info(info)

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        """Not available: torch_xla 2.9 has no call that resets the PJRT peak."""
        kind = self.pjrt_device_type or "XLA"
        raise NotSupportedError(
            f"xla ({kind}): torch_xla has no call to reset the PJRT peak-memory counter "
            "(peak_bytes_used counts from process start); compare memory_stats() against "
            "a baseline instead"
        )

    # -- streams and events --------------------------------------------------------------
    def new_stream(self, device: torch.device | None = None) -> Stream:
        raise NotSupportedError(_NO_STREAMS)

    def current_stream(self, device: torch.device | None = None) -> Stream:
        raise NotSupportedError(_NO_STREAMS)

    def use_stream(self, stream: Stream) -> AbstractContextManager[None]:
        raise NotSupportedError(_NO_STREAMS)

    def new_event(self, enable_timing: bool = True) -> Event:
        raise NotSupportedError(_NO_EVENTS)

    def synchronize(self, device: torch.device | None = None) -> None:
        """Cut the pending lazy graph (``torch_xla.sync()``) and wait for the device."""
        torch_xla, xm = _xla()
        target = self._resolve(device)
        torch_xla.sync()
        xm.wait_device_ops(xm.xla_real_devices([target]))

    # -- RNG -----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed every XLA device of this process (``xm.set_rng_state``)."""
        torch_xla, xm = _xla()
        for device in torch_xla.devices():
            xm.set_rng_state(int(seed), str(device))

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        _, xm = _xla()
        return encode_rng_state(int(xm.get_rng_state(str(self._resolve(device)))))

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        _, xm = _xla()
        xm.set_rng_state(decode_rng_state(state), str(self._resolve(device)))

    # -- dtypes --------------------------------------------------------------------------
    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """The reduced-precision dtypes the PJRT device computes with, probed once.

        Each candidate runs a small add and multiply on the device and is kept when the
        result comes back exact (the values are representable in every format).
        """
        if self._dtypes is None:
            device = self.current_device()
            found = {
                d for d in torch_dtypes_by_name(REDUCED_PRECISION_DTYPES) if _computes(d, device)
            }
            self._dtypes = frozenset(found)
        return self._dtypes


def _computes(dtype: torch.dtype, device: torch.device) -> bool:
    want = torch.tensor([3.0, -4.0, 3.0, -4.0])
    try:
        x = torch.tensor([1.5, -2.0], device=device).to(dtype)
        got = torch.cat([x + x, x * 2]).to(torch.float32).cpu()
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return torch.equal(got, want)
