"""The contract checks: :class:`BackendConformance`."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from lamina.device.backend import Availability, Backend
from lamina.device.handle import DeviceHandle, Stream
from lamina.device.kernels import REFERENCE, KernelLauncher
from lamina.device.topology import merge_host_topologies
from lamina.device.topology_file import load_topology, save_topology
from lamina.errors import NotSupportedError
from lamina.plugins import get_registry
from lamina.testing.conformance._collectives import CollectiveRun, check_collective
from lamina.testing.conformance._common import capability
from lamina.testing.conformance._device_work import (
    MEMORY_BLOCK_BYTES,
    assert_ordered,
    assert_synchronized,
    bytes_needed,
    calibrated_work,
    figure_delta,
)
from lamina.testing.conformance._kernels import (
    KERNEL_COMPARISONS,
    KERNEL_SAMPLES,
    KernelComparison,
    KernelSample,
    compare_calls,
    comparison_for,
)

# --------------------------------------------------------------------------- the kit


class BackendConformance:
    """The contract checks; subclass it in a test module to run them (see module doc)."""

    #: Restrict to these backend names (None: every installed backend, or --lamina-backend).
    backends: ClassVar[tuple[str, ...] | None] = None

    #: Kernels the backend's plugin registers; one that launches the reference fails
    #: (e.g. registered under another backend name). Others without an implementation skip.
    expected_kernels: ClassVar[tuple[str, ...]] = ()

    #: Calls per kernel name that the kernel checks run (the built-ins by default).
    kernel_samples: ClassVar[Mapping[str, Sequence[KernelSample]]] = KERNEL_SAMPLES

    #: How a kernel's outputs are compared with the reference's, by kernel name; a kernel
    #: not named is compared bit for bit (the built-ins: all but ``scale_accumulate``).
    kernel_comparisons: ClassVar[Mapping[str, KernelComparison]] = KERNEL_COMPARISONS

    #: The device reads denormal inputs and writes denormal results as zero (DAZ and FTZ,
    #: as XLA's CPU runtime does). Where the backend runs a kernel's reference on its
    #: device, the CPU answer it must match is then computed in the same mode; it must
    #: still match bit for bit, so flushing anything else (say, normal values under 1e-6)
    #: fails. A device that flushes without declaring it fails the kernel checks.
    flushes_denormals: ClassVar[bool] = False

    # -- registration ------------------------------------------------------------------
    def test_availability_states_reason(self, lamina_backend_name: str) -> None:
        entry = get_registry().backends.get(lamina_backend_name)
        if entry is None:
            pytest.skip(f"backend {lamina_backend_name!r} is not installed")
        assert isinstance(entry.availability, Availability)
        if not entry.availability.available:
            assert entry.availability.reason.strip(), "an unavailable backend must say why"

    def test_handle_matches_backend(
        self, lamina_backend: Backend, lamina_handle: DeviceHandle
    ) -> None:
        assert lamina_handle.device_type == lamina_backend.device_type
        assert lamina_handle.collective_backend == lamina_backend.collective_backend
        assert lamina_handle.device_count() >= 1
        device = lamina_handle.device_for_local_rank(0)
        assert device.type == lamina_backend.device_type
        with pytest.raises(ValueError):
            lamina_handle.device_for_local_rank(-1)

    # -- memory --------------------------------------------------------------------------
    def test_memory_stats_see_an_allocation(self, lamina_handle: DeviceHandle) -> None:
        """Allocating 64 MiB moves ``allocated`` (device: by >= 64 MiB; process RSS: ~64 MiB)."""
        handle = lamina_handle
        device = handle.device_for_local_rank(0)
        handle.synchronize(device)
        before = capability(handle, lambda: handle.memory_stats(device))
        if before.allocated is None and before.peak is None:
            pytest.skip(f"{handle.device_type}: the runtime reports no memory figures")
        if before.allocated is None:  # only a peak: a fresh window must see the block
            capability(handle, lambda: handle.reset_peak_memory(device))
            before = handle.memory_stats(device)
        need = bytes_needed(before.scope)
        block = torch.ones(MEMORY_BLOCK_BYTES // 4, dtype=torch.float32, device=device)
        handle.synchronize(device)
        during = handle.memory_stats(device)
        del block
        assert during.scope == before.scope, f"scope changed: {before.scope} -> {during.scope}"
        figure = "allocated" if before.allocated is not None else "peak"
        grew = figure_delta(before, during, figure)
        assert grew >= need, (
            f"{handle.device_type}: memory_stats().{figure} ({during.scope}) grew by {grew} "
            f"bytes while a {MEMORY_BLOCK_BYTES}-byte block was live; want >= {need:.0f}"
        )
        if during.peak is not None and during.allocated is not None:
            assert during.peak >= during.allocated, (
                f"peak {during.peak} is below the current figure {during.allocated}"
            )

    def test_peak_memory_resets(self, lamina_handle: DeviceHandle) -> None:
        """The peak remembers a freed 64 MiB block until ``reset_peak_memory`` starts anew."""
        handle = lamina_handle
        device = handle.device_for_local_rank(0)
        handle.synchronize(device)
        first = capability(handle, lambda: handle.memory_stats(device))
        if first.peak is None:
            pytest.skip(f"{handle.device_type}: the runtime reports no peak-memory figure")
        capability(handle, lambda: handle.reset_peak_memory(device))
        base = handle.memory_stats(device)
        need = bytes_needed(base.scope)
        block = torch.ones(MEMORY_BLOCK_BYTES // 4, dtype=torch.float32, device=device)
        handle.synchronize(device)
        del block
        handle.synchronize(device)
        remembered = handle.memory_stats(device)
        grew = figure_delta(base, remembered, "peak")
        assert grew >= need, (
            f"{handle.device_type}: the peak ({base.scope}) rose by {grew} bytes over a freed "
            f"{MEMORY_BLOCK_BYTES}-byte block since reset_peak_memory(); want >= {need:.0f} "
            f"(a peak that ignores allocations, or a reset that starts no new window)"
        )
        handle.reset_peak_memory(device)
        after = handle.memory_stats(device)
        fell = figure_delta(after, remembered, "peak")
        assert fell >= need / 2, (
            f"{handle.device_type}: reset_peak_memory() lowered the peak by {fell} bytes; the "
            f"freed {MEMORY_BLOCK_BYTES}-byte block is still counted (want >= {need / 2:.0f})"
        )

    # -- graph capture (optional) ------------------------------------------------------
    def test_captured_step_replays_on_new_inputs(self, lamina_handle: DeviceHandle) -> None:
        """Where the backend declares graph capture, a captured step recomputes its
        output from the values copied into its input at each replay; where it does not,
        ``capture_step`` raises ``NotSupportedError`` with the declared reason."""
        handle = lamina_handle
        device = handle.device_for_local_rank(0)
        reason = handle.graph_capture_reason()
        static = torch.zeros(1024, dtype=torch.float32, device=device)
        if reason:
            with pytest.raises(NotSupportedError) as raised:
                handle.capture_step(lambda: static * 2 + 1)
            assert str(raised.value) == reason, (raised.value, reason)
            pytest.skip(f"{handle.device_type}: {reason}")
        captured = handle.capture_step(lambda: static * 2 + 1)
        for value in (3.0, -0.5):
            static.copy_(torch.full_like(static, value))
            captured.replay()
            handle.synchronize(device)
            out = captured.outputs.cpu()
            assert torch.equal(out, torch.full_like(out, value * 2 + 1)), (
                f"{handle.device_type}: a replay after writing {value} into the captured "
                f"input gave {out[:4].tolist()}, want {value * 2 + 1}"
            )

    # -- events --------------------------------------------------------------------------
    def test_events_time_known_work_in_order(self, lamina_handle: DeviceHandle) -> None:
        """Three events around 1 and 2 units of work: consistent, ordered, host-clock sized."""
        handle = lamina_handle
        device = handle.device_for_local_rank(0)
        first = capability(handle, lambda: handle.new_event())
        second, third = handle.new_event(), handle.new_event()
        work = calibrated_work(handle, device)
        handle.synchronize(device)
        h0 = time.perf_counter()
        first.record()
        work.run()
        second.record()
        second.synchronize()
        h1 = time.perf_counter()
        work.run(units=2)
        third.record()
        third.synchronize()
        h2 = time.perf_counter()
        assert first.query() and second.query() and third.query(), "a synchronized event is busy"
        t12, t23 = first.elapsed_time(second), second.elapsed_time(third)
        t13 = first.elapsed_time(third)
        host12, host23, host13 = (h1 - h0) * 1e3, (h2 - h1) * 1e3, (h2 - h0) * 1e3
        measured = f"e1->e2 {t12:.3f} ms, e2->e3 {t23:.3f} ms, e1->e3 {t13:.3f} ms"
        for value in (t12, t23, t13):
            assert math.isfinite(value) and value >= 0, f"events out of order: {measured}"
        assert abs(t13 - (t12 + t23)) <= 0.01 * t13 + 0.05, (
            f"e1->e3 is not e1->e2 + e2->e3: {measured}"
        )
        # The host clock ran around the same work: an event interval cannot be longer than
        # the host window holding it, nor shorter than a third of the work it brackets.
        for label, got, low, high in (
            ("e1->e2 (1 unit)", t12, host12 / 3, host12),
            ("e2->e3 (2 units)", t23, host23 / 3, host13),
            ("e1->e3 (3 units)", t13, host13 / 3, host13),
        ):
            assert low <= got <= high * 1.05 + 1.0, (
                f"{label} timed {got:.3f} ms; the host clock around it says "
                f"{low:.3f}..{high:.3f} ms ({measured})"
            )

    # -- streams -------------------------------------------------------------------------
    def test_new_stream_is_distinct(self, lamina_handle: DeviceHandle) -> None:
        """``new_stream`` gives a stream other than the current one, and work runs on it."""
        handle = lamina_handle
        device, side, main = _two_streams(handle)
        assert side != main, "new_stream() returned the current stream"
        assert handle.current_stream(device) == main, "current_stream() is not stable"
        with handle.use_stream(side):
            on_side = torch.arange(1024, device=device, dtype=torch.float32) * 2
        side.synchronize()
        assert side.query(), "a synchronized stream reports queued work"
        assert float(on_side.sum().item()) == 1024 * 1023

    def test_wait_stream_orders_work(self, lamina_handle: DeviceHandle) -> None:
        """A read queued after ``wait_stream`` sees a long write on the other stream."""
        handle = lamina_handle
        device, side, main = _two_streams(handle)
        work = calibrated_work(handle, device)
        assert_ordered(
            handle, device, work, side, main, lambda: main.wait_stream(side), "main.wait_stream"
        )
        assert_ordered(
            handle, device, work, main, side, lambda: side.wait_stream(main), "side.wait_stream"
        )

    def test_wait_event_orders_work(self, lamina_handle: DeviceHandle) -> None:
        """A read queued after ``Stream.wait_event`` / ``Event.wait`` sees the long write."""
        handle = lamina_handle
        device, side, main = _two_streams(handle)
        work = calibrated_work(handle, device)
        assert_ordered(
            handle,
            device,
            work,
            side,
            main,
            lambda: main.wait_event(side.record_event()),
            "Stream.wait_event",
        )
        assert_ordered(
            handle,
            device,
            work,
            side,
            main,
            lambda: side.record_event().wait(main),
            "Event.wait",
        )

    def test_synchronize_waits_for_queued_work(self, lamina_handle: DeviceHandle) -> None:
        """Stream, event and device ``synchronize`` return only after a long write landed."""
        handle = lamina_handle
        device, side, _ = _two_streams(handle)
        work = calibrated_work(handle, device)
        for what, sync in (
            ("Stream.synchronize", side.synchronize),
            ("Event.synchronize", lambda: side.record_event().synchronize()),
            ("DeviceHandle.synchronize", lambda: handle.synchronize(device)),
        ):
            assert_synchronized(handle, device, work, side, sync, what)
        assert side.query(), "a synchronized stream reports queued work"

    # -- RNG and dtypes ------------------------------------------------------------------
    def test_rng_state_round_trip(self, lamina_handle: DeviceHandle) -> None:
        device = lamina_handle.device_for_local_rank(0)
        lamina_handle.manual_seed(1234)
        state = lamina_handle.get_rng_state(device)
        first = torch.randn(64, device=device)
        lamina_handle.set_rng_state(state, device)
        again = torch.randn(64, device=device)
        assert torch.equal(first.cpu(), again.cpu())
        lamina_handle.manual_seed(1234)
        assert torch.equal(torch.randn(64, device=device).cpu(), first.cpu())

    def test_supported_dtypes_convert(self, lamina_handle: DeviceHandle) -> None:
        """fp32 -> dtype -> fp32 rounds to nearest: each value within half an ulp of it."""
        device = lamina_handle.device_for_local_rank(0)
        assert torch.float32 not in lamina_handle.supported_dtypes()
        # 100 values in [-2, 2] (none under 0.02: normal in every format), and an exact zero
        x = torch.cat([torch.linspace(-2, 2, 100), torch.zeros(1)]).to(device)
        for dtype in sorted(lamina_handle.supported_dtypes(), key=str):
            back = x.to(dtype).to(torch.float32)
            assert lamina_handle.supports(dtype)
            bound = round_trip_bound(dtype)
            want = x.cpu().double()
            error = (back.cpu().double() - want).abs()
            worst = int((error - bound * want.abs()).argmax())
            assert bool((error <= bound * want.abs()).all()), (
                f"{dtype}: {want[worst].item()!r} came back as {back.cpu()[worst].item()!r}, "
                f"a relative error of {(error[worst] / want[worst].abs()).item():.3g}; round "
                f"to nearest stays within {bound:.3g} (half an ulp)"
            )

    # -- kernels ---------------------------------------------------------------------------
    def test_kernel_matches_reference(
        self, lamina_backend: Backend, lamina_handle: DeviceHandle, lamina_kernel_name: str
    ) -> None:
        """The backend's own implementation runs and matches the reference on every sample.

        Values, arguments after the call (in-place writes, a zeroed tail) and which results
        alias the inputs (views, ``out=``) must all agree with the reference: bit for bit,
        unless :attr:`kernel_comparisons` gives the kernel a bound (``scale_accumulate``:
        what a fused multiply-add may change). A kernel the
        backend does not implement is reported as running the reference (a skip); off the
        CPU the reference on the device must still give the CPU's answer.
        """
        name, backend = lamina_kernel_name, lamina_backend.name
        registry = get_registry().kernels
        assert name in registry.names(), f"kernel {name!r} is missing from the registry"
        launcher = KernelLauncher(registry, backend)
        impl = launcher.implementation_name(name)
        device = lamina_handle.device_for_local_rank(0)
        samples = self.kernel_samples[name]
        compare = comparison_for(name, self.kernel_comparisons)
        if impl == REFERENCE:
            registered = ", ".join(registry.backends_for(name)) or "none"
            assert name not in self.expected_kernels, (
                f"{backend}: {name} launches the reference: no implementation is registered "
                f"under {backend!r} (registered for: {registered})"
            )
            said = f"{backend}: {name} runs the reference (no {backend} implementation)"
            if device.type == "cpu":
                pytest.skip(said)
            cpu = torch.device("cpu")

            def on_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if not self.flushes_denormals:
                    return launcher.reference(name, *args, **kwargs)
                with cpu_flushing_denormals(backend):
                    return launcher.reference(name, *args, **kwargs)

            for i, sample in enumerate(samples):
                compare_calls(
                    lambda a, k: launcher.launch(name, *a, **k),
                    sample(device),
                    on_cpu,
                    sample(cpu),
                    lambda: lamina_handle.synchronize(device),
                    f"{name} (reference on {device} vs the CPU), sample {i}",
                    aliasing=False,
                    compare=compare,
                )
            flushed = " (denormals flushed, as declared)" if self.flushes_denormals else ""
            pytest.skip(f"{said}; on {device} it gives the CPU's answer{flushed}")
        fn, _ = registry.implementation(name, backend)
        assert fn is not registry.spec(name).reference, (
            f"{backend}: registered the reference of {name} as its own implementation"
        )
        for i, sample in enumerate(samples):
            call = sample(device)
            compare_calls(
                lambda a, k: launcher.launch(name, *a, **k),
                call,
                lambda a, k: launcher.reference(name, *a, **k),
                call,
                lambda: lamina_handle.synchronize(device),
                f"{name} ({impl} implementation), sample {i}",
                compare=compare,
            )

    # -- topology ------------------------------------------------------------------------
    def test_topology_json_round_trip(self, lamina_backend: Backend, tmp_path: Path) -> None:
        piece = lamina_backend.discover_host_topology(0, 1)
        assert piece.device_type == lamina_backend.device_type
        topology = merge_host_topologies([piece])
        path = tmp_path / "topology.json"
        save_topology(topology, path)
        assert load_topology(path) == topology

    # -- collectives (one 2-rank job per class, shared through ``lamina_collectives``) ----
    @pytest.mark.timeout(180)
    def test_collective_all_reduce(self, lamina_collectives: CollectiveRun) -> None:
        check_collective(lamina_collectives, "all_reduce")

    @pytest.mark.timeout(180)
    def test_collective_broadcast(self, lamina_collectives: CollectiveRun) -> None:
        check_collective(lamina_collectives, "broadcast")

    @pytest.mark.timeout(180)
    def test_collective_all_gather(self, lamina_collectives: CollectiveRun) -> None:
        check_collective(lamina_collectives, "all_gather")

    @pytest.mark.timeout(180)
    def test_collective_reduce_scatter(self, lamina_collectives: CollectiveRun) -> None:
        check_collective(lamina_collectives, "reduce_scatter")


@contextmanager
def cpu_flushing_denormals(backend: str) -> Iterator[None]:
    """The CPU in the mode of a device that flushes denormals (``torch.set_flush_denormal``:
    DAZ and FTZ on x86), back to the default after; skips where this CPU has no such mode.

    The mode is a per-thread register, so torch runs on this thread alone meanwhile.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not torch.set_flush_denormal(True):
            pytest.skip(f"{backend} flushes denormals; this CPU cannot, to compute its answer")
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def _two_streams(handle: DeviceHandle) -> tuple[torch.device, Stream, Stream]:
    """Local rank 0's device, a new stream on it (skips where the device has none) and
    its current stream."""
    device = handle.device_for_local_rank(0)
    side = capability(handle, lambda: handle.new_stream(device))
    return device, side, handle.current_stream(device)


#: Mantissa bits (the implicit leading one included) of the reduced-precision formats.
#: Rounding to nearest errs by at most half an ulp, that is by 2**-bits relative to a
#: normal value: bf16 8 bits (2**-8 = 0.39%), fp16 11 (2**-11 = 0.049%), float8_e4m3fn
#: 4 (2**-4 = 6.25%), float8_e5m2 3 (2**-3 = 12.5%).
MANTISSA_BITS: dict[torch.dtype, int] = {
    torch.bfloat16: 8,
    torch.float16: 11,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 3,
}


def round_trip_bound(dtype: torch.dtype) -> float:
    """The largest relative error of fp32 -> ``dtype`` -> fp32 for a normal value,
    ``2 ** -mantissa_bits`` (another float format: ``eps / 2``, the same figure)."""
    bits = MANTISSA_BITS.get(dtype)
    if bits is None:
        assert dtype.is_floating_point, f"{dtype}: a supported dtype must be a float format"
        return torch.finfo(dtype).eps / 2
    return 2.0**-bits
