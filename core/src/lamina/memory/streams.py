"""The communication stream a unit's collectives are issued on, ordered against compute.

Where the device has streams, gathers and reduce-scatters run on a stream of their own,
so that they overlap the computation; the helpers here order the two streams (the comm
stream waits for what compute wrote, compute waits for what the comm stream produced).
Without streams (``None``: the CPU, or a backend that orders work itself, such as XLA)
every helper does nothing and work is issued on the current stream.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from lamina.device.handle import DeviceHandle, Event, Stream


@dataclass
class CommStreams:
    """The handle and its communication stream, and the compute stream they order against."""

    handle: DeviceHandle
    comm: Stream
    compute: Stream


def comm_streams(handle: DeviceHandle | None, device: torch.device) -> CommStreams | None:
    """A communication stream from ``handle`` (None on the CPU or where streams are
    unsupported: work is then issued on the current stream)."""
    if handle is None or device.type == "cpu":
        return None
    try:
        return CommStreams(handle, handle.new_stream(device), handle.current_stream(device))
    except Exception:  # NotSupportedError (XLA orders work in its lazy graph)
        return None


def on_comm(streams: CommStreams | None) -> AbstractContextManager[None]:
    """Within the block, work is issued on the comm stream (without streams: as it is)."""
    return nullcontext() if streams is None else streams.handle.use_stream(streams.comm)


def ready_for_comm(streams: CommStreams | None) -> None:
    """The comm stream waits for what compute wrote (the gradient)."""
    if streams is not None:
        streams.comm.wait_stream(streams.compute)


def record_comm(streams: CommStreams | None) -> Event | None:
    """An event marking the work issued on the comm stream so far (None: no streams)."""
    return None if streams is None else streams.comm.record_event()


def wait_event(streams: CommStreams | None, event: Event | None) -> None:
    """Compute waits for a gather issued on the comm stream."""
    if streams is not None and event is not None:
        streams.compute.wait_event(event)


def wait_comm(streams: CommStreams | None) -> None:
    """Compute waits for everything issued on the comm stream."""
    if streams is not None:
        streams.compute.wait_stream(streams.comm)
