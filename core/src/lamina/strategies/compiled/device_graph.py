"""A compiled step replayed as a device graph: :class:`DeviceGraphs`.

Where the device captures a step (:meth:`DeviceHandle.capture_step`: CUDA graphs), each
compiled input shape, once its graph has run (compiled, warm), is captured on its next
call and replayed from then on: the batch and the learning rates are copied into the
tensors the capture read, and the whole step (kernels and collectives) launches at
once. Everything else the step reads (parameters, optimizer state, buffers) is updated
in place, at fixed addresses, as a captured step needs. Where the device does not, or
``device_graphs=False``, :attr:`DeviceGraphs.reason` says why and the compiled step
launches its kernels one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lamina.device.handle import CapturedStep, DeviceHandle


@dataclass
class _Capture:
    """One shape's captured step and the tensors it reads its batch and rates from."""

    step: CapturedStep
    batch: list[Any]
    rates: list[torch.Tensor]


class DeviceGraphs:
    """The captured step of each compiled shape (see the module docstring)."""

    def __init__(self, handle: DeviceHandle | None, wanted: bool, backend: object) -> None:
        self.handle = handle
        if not wanted:
            reason = "device_graphs=False"
        elif handle is None:
            reason = "no lamina runtime: the device is unknown"
        else:
            reason = handle.graph_capture_reason()
        if not reason and backend != "inductor":
            reason = f"device graphs replay Inductor's code, not backend={backend!r}"
        #: Why steps are not replayed as device graphs ('' when they are).
        self.reason = reason
        self._captures: dict[Hashable, _Capture] = {}

    @property
    def device(self) -> torch.device | None:
        """Where the step's small tensors (learning rates, step counters) live when it is
        captured: the device's (None: wherever they are)."""
        if self.reason or self.handle is None:
            return None
        return self.handle.current_device()

    def run(
        self,
        shape: Hashable,
        step: Callable[[list[Any], list[torch.Tensor]], torch.Tensor],
        batch: Sequence[Any],
        rates: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """``step(batch, rates)`` of a compiled shape: captured at its first call here
        (then replayed once, which runs it), replayed with new values afterwards."""
        assert self.handle is not None and not self.reason
        capture = self._captures.get(shape)
        if capture is None:
            fixed = [v.clone() if isinstance(v, torch.Tensor) else v for v in batch]
            fixed_rates = [r.clone() for r in rates]
            captured = self.handle.capture_step(lambda: step(fixed, fixed_rates), warmup=0)
            capture = self._captures[shape] = _Capture(captured, fixed, fixed_rates)
        else:
            for mine, new in zip(capture.batch, batch, strict=True):
                if isinstance(mine, torch.Tensor):
                    mine.copy_(new)
            for mine_rate, new_rate in zip(capture.rates, rates, strict=True):
                mine_rate.copy_(new_rate)
        capture.step.replay()
        loss: torch.Tensor = capture.step.outputs.clone()  # the next replay rewrites it
        return loss
