"""DeviceHandle for NVIDIA GPUs: thin wrappers over ``torch.cuda`` streams, events and memory.

Only imported once the backend said it is available (a CUDA build of torch that sees a
device); nothing here re-implements what ``torch.cuda`` gives.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

import torch

from lamina.device.accelerator import AcceleratorHandle
from lamina.device.handle import CapturedStep, Event, Stream, torch_dtypes_by_name
from lamina.device.torch_streams import TorchEvent, TorchStream
from lamina.errors import NotSupportedError

__all__ = ["FP8_MIN_CAPABILITY", "CudaEvent", "CudaHandle", "CudaStream"]

#: Compute capability from which the device has FP8 (e4m3fn / e5m2) tensor-core support.
FP8_MIN_CAPABILITY = (8, 9)


# torch.cuda's Event/Stream constructors carry no annotations in some releases.
_new_event = cast("Callable[..., torch.cuda.Event]", torch.cuda.Event)
_new_stream = cast("Callable[..., torch.cuda.Stream]", torch.cuda.Stream)


class CudaEvent(TorchEvent):
    """A ``torch.cuda.Event``."""

    raw: torch.cuda.Event

    def __init__(self, enable_timing: bool = True) -> None:
        super().__init__(_new_event(enable_timing=enable_timing), enable_timing)


class CudaStream(TorchStream):
    """A ``torch.cuda.Stream``; use ``torch.cuda.stream(s.raw)`` to queue work on it."""

    event_class = CudaEvent
    raw: torch.cuda.Stream

    def __init__(self, raw: torch.cuda.Stream) -> None:
        super().__init__(raw)

    @property
    def device(self) -> torch.device:
        """The device the stream belongs to."""
        return torch.device(self.raw.device)

    def new_event(self) -> CudaEvent:
        """A new timing ``torch.cuda.Event``."""
        return CudaEvent()


CudaEvent.stream_class = CudaStream


def _device(device: torch.device | int | None) -> torch.device | int | None:
    if isinstance(device, torch.device) and device.type != "cuda":
        raise ValueError(f"the cuda backend manages 'cuda' devices, not {device!r}")
    return device


class CudaCapturedStep(CapturedStep):
    """A step captured as a CUDA graph."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Any) -> None:
        self.graph = graph
        self.outputs = outputs

    def replay(self) -> None:
        """Launch the whole graph at once on the current stream."""
        self.graph.replay()


class CudaHandle(AcceleratorHandle):
    """DeviceHandle over ``torch.accelerator`` (device, synchronization, memory figures;
    ``torch.cuda`` where an older torch lacks them) and ``torch.cuda`` streams and events."""

    device_type = "cuda"
    collective_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def vendor(self) -> Any:
        """``torch.cuda``."""
        return torch.cuda

    def new_stream(self, device: torch.device | None = None) -> Stream:
        return CudaStream(_new_stream(device=_device(device)))

    def current_stream(self, device: torch.device | None = None) -> Stream:
        return CudaStream(torch.cuda.current_stream(_device(device)))

    def use_stream(self, stream: Stream) -> AbstractContextManager[None]:
        if not isinstance(stream, CudaStream):
            raise TypeError(f"the cuda backend needs a CudaStream, got {type(stream).__name__}")
        return cast("AbstractContextManager[None]", torch.cuda.stream(stream.raw))

    def new_event(self, enable_timing: bool = True) -> Event:
        return CudaEvent(enable_timing)

    def manual_seed(self, seed: int) -> None:
        """Seed the generators of every visible GPU."""
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device if device is not None else "cuda")

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        torch.cuda.set_rng_state(state, device if device is not None else "cuda")

    def graph_capture_reason(self) -> str:
        """'' where a GPU is visible: CUDA graphs capture a step's kernels."""
        if not torch.cuda.is_available():
            return "CUDA graphs need a visible GPU; torch.cuda.is_available() is False"
        return ""

    def capture_step(self, step: Callable[[], Any], warmup: int = 2) -> CapturedStep:
        """``step`` as a ``torch.cuda.CUDAGraph``: ``warmup`` calls on a side stream (as
        CUDA graphs want: the allocator and lazy initializations settle there), then one
        captured call."""
        reason = self.graph_capture_reason()
        if reason:
            raise NotSupportedError(reason)
        side = _new_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        return CudaCapturedStep(graph, outputs)

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """fp16; bf16 where torch says the GPU supports it; fp8 from compute capability 8.9."""
        names = ["float16"]
        if torch.cuda.is_bf16_supported():
            names.append("bfloat16")
        if torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY:
            names += ["float8_e4m3fn", "float8_e5m2"]
        return torch_dtypes_by_name(tuple(names))
