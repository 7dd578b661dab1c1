"""Generic :class:`Event` / :class:`Stream` wrappers over torch-style stream and event objects.

Any object with the ``torch.Stream`` / ``torch.Event`` API (``torch.cuda``, ``torch.npu``,
``torch.xpu``, the device-generic ``torch.Stream``...) is wrapped as ``raw``. A backend
subclasses both classes, points them at each other with :attr:`TorchEvent.stream_class`
and :attr:`TorchStream.event_class` (so streams and events of another backend are refused
with a ``TypeError``), and overrides :meth:`TorchStream.new_event` when its events are
not made by ``torch.Event``.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import torch

from lamina.device.handle import Event, Stream

__all__ = ["TorchEvent", "TorchStream"]

_T = TypeVar("_T")


def _require(obj: object, cls: type[_T], where: str) -> _T:
    """``obj`` if it is a ``cls``; else a TypeError naming ``cls`` (another backend's object)."""
    if not isinstance(obj, cls):
        raise TypeError(
            f"{where} needs {cls.__name__}, got {type(obj).__name__}; "
            "use streams and events made by the same backend's DeviceHandle"
        )
    return obj


class TorchEvent(Event):
    """An event wrapping ``raw``, an object with the ``torch.Event`` API.

    ``enable_timing`` must say how ``raw`` was created: :meth:`elapsed_time` refuses events
    made without timing.
    """

    #: The stream class :meth:`record` and :meth:`wait` accept (set by each backend).
    stream_class: ClassVar[type[TorchStream]]

    def __init__(self, raw: Any, enable_timing: bool = True) -> None:
        self.raw = raw
        self.enable_timing = enable_timing

    def _raw_stream(self, stream: Stream | None, where: str) -> Any:
        if stream is None:
            return None
        return _require(stream, self.stream_class, where).raw

    def record(self, stream: Stream | None = None) -> None:
        self.raw.record(self._raw_stream(stream, f"{type(self).__name__}.record"))

    def wait(self, stream: Stream | None = None) -> None:
        self.raw.wait(self._raw_stream(stream, f"{type(self).__name__}.wait"))

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return bool(self.raw.query())

    def elapsed_time(self, end: Event) -> float:
        other = _require(end, type(self), "elapsed_time")
        if not (self.enable_timing and other.enable_timing):
            raise RuntimeError(
                "elapsed_time needs two timing events; create them with enable_timing=True"
            )
        return float(self.raw.elapsed_time(other.raw))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchEvent) and self.raw == other.raw

    def __hash__(self) -> int:
        return hash(self.raw)


class TorchStream(Stream):
    """A stream wrapping ``raw``, an object with the ``torch.Stream`` API."""

    #: The event class :meth:`wait_event` and :meth:`record_event` accept.
    event_class: ClassVar[type[TorchEvent]] = TorchEvent

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def new_event(self) -> TorchEvent:
        """A new timing event for :meth:`record_event`.

        The default makes a ``torch.Event`` on the stream's device and passes it to
        :attr:`event_class`; a backend whose events are built differently overrides this.
        """
        return self.event_class(torch.Event(self.raw.device, enable_timing=True))

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return bool(self.raw.query())

    def wait_event(self, event: Event) -> None:
        self.raw.wait_event(_require(event, self.event_class, "wait_event").raw)

    def wait_stream(self, other: Stream) -> None:
        self.raw.wait_stream(_require(other, type(self), "wait_stream").raw)

    def record_event(self, event: Event | None = None) -> Event:
        if event is None:
            event = self.new_event()
        self.raw.record_event(_require(event, self.event_class, "record_event").raw)
        return event

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchStream) and self.raw == other.raw

    def __hash__(self) -> int:
        return hash(self.raw)


TorchEvent.stream_class = TorchStream
