"""TorchEvent / TorchStream over torch's device-generic ``torch.Stream`` / ``torch.Event`` on CPU.

torch's CPU backend has streams and events but cannot *record* events ("cpu backend doesn't
support events" in torch 2.13), so recording is exercised only where torch supports it; the
type checks, the timing-flag check and the calls that need no recorded event run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from lamina.device.handle import Event, Stream
from lamina.device.torch_streams import TorchEvent, TorchStream

pytestmark = pytest.mark.portable


class OtherEvent(TorchEvent):
    """A second backend's event class, to check that the two are not mixed."""


class OtherStream(TorchStream):
    event_class = OtherEvent


OtherEvent.stream_class = OtherStream


def cpu_stream() -> TorchStream:
    return TorchStream(torch.Stream(device="cpu"))


def cpu_event(enable_timing: bool = True) -> TorchEvent:
    return TorchEvent(torch.Event("cpu", enable_timing=enable_timing), enable_timing)


def test_wrappers_are_lamina_streams_and_events() -> None:
    stream, event = cpu_stream(), cpu_event()
    assert isinstance(stream, Stream) and isinstance(event, Event)
    assert stream.raw.device == torch.device("cpu")


def test_calls_without_recorded_work_reach_torch() -> None:
    stream, event = cpu_stream(), cpu_event()
    assert stream.query() is True
    stream.synchronize()
    assert event.query() is True  # an unrecorded event counts as complete
    event.synchronize()
    event.wait(stream)
    event.wait()
    stream.wait_event(event)


def test_equality_and_hash_follow_raw() -> None:
    raw = torch.Stream(device="cpu")
    a, b = TorchStream(raw), TorchStream(raw)
    assert a == b and hash(a) == hash(b)
    assert a != raw  # a wrapper never equals a bare torch object
    event_raw = torch.Event("cpu")
    assert TorchEvent(event_raw) == TorchEvent(event_raw)
    assert TorchEvent(event_raw) != cpu_event()
    assert len({TorchEvent(event_raw), TorchEvent(event_raw)}) == 1


def test_new_event_is_a_timing_event_of_the_stream_class() -> None:
    event = OtherStream(torch.Stream(device="cpu")).new_event()
    assert type(event) is OtherEvent and event.enable_timing
    assert isinstance(event.raw, torch.Event)


def test_streams_and_events_of_another_backend_are_refused() -> None:
    stream, event = cpu_stream(), cpu_event()
    other_stream = OtherStream(torch.Stream(device="cpu"))
    other_event = OtherEvent(torch.Event("cpu"))
    with pytest.raises(TypeError, match="needs OtherStream, got TorchStream"):
        other_event.record(stream)
    with pytest.raises(TypeError, match="needs OtherStream, got TorchStream"):
        other_event.wait(stream)
    with pytest.raises(TypeError, match="needs OtherEvent, got TorchEvent"):
        other_stream.wait_event(event)
    with pytest.raises(TypeError, match="needs OtherEvent, got TorchEvent"):
        other_stream.record_event(event)
    with pytest.raises(TypeError, match="wait_stream needs OtherStream, got TorchStream"):
        other_stream.wait_stream(stream)
    with pytest.raises(TypeError, match="elapsed_time needs OtherEvent, got TorchEvent"):
        other_event.elapsed_time(event)
    with pytest.raises(TypeError, match="wait_event needs TorchEvent, got object"):
        stream.wait_event(object())  # type: ignore[arg-type]


def test_elapsed_time_needs_timing_events() -> None:
    for start, end in [(cpu_event(False), cpu_event()), (cpu_event(), cpu_event(False))]:
        with pytest.raises(RuntimeError, match="enable_timing=True"):
            start.elapsed_time(end)


def test_record_and_time_where_torch_supports_cpu_events() -> None:
    stream = cpu_stream()
    try:
        start = stream.record_event()
    except RuntimeError as exc:
        # torch's own refusal, reached through TorchStream.record_event -> torch.Stream
        assert "support events" in str(exc)
        pytest.skip(f"torch {torch.__version__}: {exc}")
    end = cpu_event()
    end.record(stream)
    end.synchronize()
    assert start.query() and end.query()
    assert start.elapsed_time(end) >= 0.0
