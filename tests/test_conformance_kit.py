"""The conformance kit fails a broken backend check by check, and passes the intact one.

Each test runs kit checks in a nested pytest session (``pytester``), on a generated
``BackendConformance`` subclass, against backends from ``conformance_backends.py``:
``kit-async`` (an emulated asynchronous device, correct) and one backend per fault. They
are installed as a lamina plugin through the entry point of a throwaway distribution put
on ``sys.path``, the way a backend package is found, so the spawned ranks of the
collective checks find them too.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lamina.backends.cpu import CpuHandle
from lamina.plugins import get_registry
from lamina.testing.conformance import (
    MANTISSA_BITS,
    BackendConformance,
    cpu_flushing_denormals,
    round_trip_bound,
)

pytest_plugins = ("pytester",)

HERE = Path(__file__).parent
DIST = "lamina-conformance-kit-backends"

MEMORY = ("test_memory_stats_see_an_allocation", "test_peak_memory_resets")
EVENTS = ("test_events_time_known_work_in_order",)
STREAMS = (
    "test_new_stream_is_distinct",
    "test_wait_stream_orders_work",
    "test_wait_event_orders_work",
    "test_synchronize_waits_for_queued_work",
)
KERNELS = ("test_kernel_matches_reference",)
COLLECTIVES = tuple(
    f"test_collective_{op}" for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
)
OTHERS = (
    "test_availability_states_reason",
    "test_handle_matches_backend",
    "test_rng_state_round_trip",
    "test_supported_dtypes_convert",
    "test_topology_json_round_trip",
)


@dataclass(frozen=True)
class Outcome:
    """How one kit check ended in the nested session, and its message."""

    outcome: str
    message: str

    @property
    def headline(self) -> str:
        """The first ``E`` line of a failure (the assertion message), else the message."""
        for line in self.message.splitlines():
            if line.startswith("E "):
                return line[1:].strip()
        return self.message.strip().splitlines()[-1] if self.message.strip() else ""


@pytest.fixture(scope="module")
def kit_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``conformance_backends`` installed as a lamina plugin (entry point on sys.path)."""
    site = tmp_path_factory.mktemp("kit-site")
    info = site / f"{DIST.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lamina]\nconformance-kit = conformance_backends\n")
    added = [str(site), str(HERE)]
    sys.path[:0] = added
    importlib.invalidate_caches()
    try:
        record = get_registry(reload=True).records["conformance-kit"]
        assert record.status == "loaded", record.error
        yield
    finally:
        for entry in added:
            sys.path.remove(entry)
        importlib.invalidate_caches()
        get_registry(reload=True)


def run_kit(
    pytester: pytest.Pytester,
    backends: Sequence[str],
    checks: Sequence[str],
    expected_kernels: tuple[str, ...] = (),
) -> dict[str, Outcome]:
    """Run ``checks`` of a kit subclass for ``backends``; outcome by test id."""
    pytester.makepyfile(
        test_kit=(
            "from lamina.testing.conformance import BackendConformance\n\n\n"
            "class TestKit(BackendConformance):\n"
            f"    backends = {tuple(backends)!r}\n"
            f"    expected_kernels = {expected_kernels!r}\n"
        )
    )
    args = [f"test_kit.py::TestKit::{check}" for check in checks]
    reprec = pytester.inline_run(*args, "-p", "no:cacheprovider", "-p", "no:timeout")
    outcomes: dict[str, Outcome] = {}
    for report in reprec.getreports("pytest_runtest_logreport"):
        name = report.nodeid.split("::")[-1]
        if report.when == "call" or report.outcome != "passed":
            longrepr = report.longrepr
            message = longrepr[2] if isinstance(longrepr, tuple) else report.longreprtext
            outcomes.setdefault(name, Outcome(report.outcome, message))
    for name, outcome in sorted(outcomes.items()):  # shown with -s, or when a test fails
        print(f"{name}: {outcome.outcome.upper()}: {outcome.headline}")
    return outcomes


def assert_failed(outcome: Outcome, *phrases: str) -> None:
    assert outcome.outcome == "failed", outcome
    for phrase in phrases:
        assert phrase in outcome.message, (phrase, outcome.message)


# --------------------------------------------------------------------------- the device


def test_the_emulated_side_stream_is_asynchronous(kit_plugin: None) -> None:
    """Without a wait a host read misses a side stream's write; after synchronize it sees it."""
    from conformance_backends import KitStream

    handle = get_registry().backend("kit-async").handle()
    side = handle.new_stream()
    assert isinstance(side, KitStream) and side.worker is not None
    gate = threading.Event()
    side.worker.submit(gate.wait)  # the stream is busy until the test opens the gate
    out = torch.zeros(64)
    with handle.use_stream(side):
        assert handle.current_stream() is side
        total = (torch.arange(64.0) + 1).sum()  # deferred: a placeholder now
        out.copy_(torch.arange(64.0) + 1)
    assert handle.current_stream() is not side
    early = out.clone()
    assert not side.query()
    gate.set()
    handle.synchronize()
    assert side.query()
    assert torch.equal(early, torch.zeros(64))
    assert torch.equal(out, torch.arange(64.0) + 1)
    assert total.item() == 64 * 65 / 2


# --------------------------------------------------------------------------- intact


def test_the_intact_device_passes_every_check(pytester: pytest.Pytester, kit_plugin: None) -> None:
    got = run_kit(
        pytester,
        ["kit-async"],
        MEMORY + EVENTS + STREAMS + KERNELS + OTHERS,
        expected_kernels=("pack_bucket", "scale_accumulate"),
    )
    for kernel in ("unpack_bucket", "fp8_quantize", "fp8_dequantize"):
        reference = f"test_kernel_matches_reference[kit-async-{kernel}@reference]"
        assert got.pop(reference) == Outcome(
            "skipped",
            f"Skipped: kit-async: {kernel} runs the reference (no kit-async implementation)",
        )
    assert len(got) == len(MEMORY + EVENTS + STREAMS + OTHERS) + 2
    assert {name: o.outcome for name, o in got.items() if o.outcome != "passed"} == {}
    assert "test_kernel_matches_reference[kit-async-scale_accumulate@kit-async]" in got


@pytest.mark.multiprocess
def test_missing_capabilities_skip_with_the_backends_reasons(
    pytester: pytest.Pytester, kit_plugin: None
) -> None:
    """XLA's gaps (no memory figures, peak reset, streams, events or 2-rank CPU runs) skip."""
    got = run_kit(pytester, ["kit-xla-like"], MEMORY + EVENTS + STREAMS + COLLECTIVES)
    reasons = {name.split("[")[0]: o.message for name, o in got.items() if o.outcome == "skipped"}
    no_streams = "Skipped: cpu: kit: this device runs one queue; there are no user streams"
    assert reasons == {
        MEMORY[0]: "Skipped: cpu: the runtime reports no memory figures",
        MEMORY[1]: "Skipped: cpu: the runtime reports no peak-memory figure",
        EVENTS[0]: "Skipped: cpu: kit: no device events; time with synchronize()",
        **{check: no_streams for check in STREAMS},
        **{
            check: "Skipped: kit-xla-like: kit: this runtime runs one process only"
            for check in COLLECTIVES
        },
    }


def test_a_host_without_a_peak_reset_skips_the_peak_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """CpuHandle without /proc/self/clear_refs: NotSupportedError, so the kit skips."""

    def no_clear_refs(path: str, *args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("lamina.backends.cpu.open", no_clear_refs, raising=False)
    with pytest.raises(pytest.skip.Exception, match="cpu: cannot reset peak RSS on this system"):
        BackendConformance().test_peak_memory_resets(CpuHandle())


def test_the_round_trip_bound_is_half_an_ulp_and_catches_truncation() -> None:
    """2**-mantissa_bits per format; a conversion that truncates instead of rounding exceeds it."""
    assert {d: round_trip_bound(d) for d in MANTISSA_BITS} == {
        torch.bfloat16: 2**-8,
        torch.float16: 2**-11,
        torch.float8_e4m3fn: 2**-4,
        torch.float8_e5m2: 2**-3,
    }
    for dtype in MANTISSA_BITS:
        assert round_trip_bound(dtype) == torch.finfo(dtype).eps / 2
    x = torch.linspace(-2, 2, 100)
    bound = round_trip_bound(torch.bfloat16) * x.abs()
    rounded = x.to(torch.bfloat16).float()
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # bf16 by chopping
    assert bool(((rounded - x).abs() <= bound).all())
    assert not bool(((truncated - x).abs() <= bound).all())


def test_the_cpu_answer_for_a_flushing_device_flushes_on_every_thread() -> None:
    """``flushes_denormals``: the CPU reference runs with denormals read and written as
    zero, on every element (one thread), and the CPU is back to normal afterwards."""
    threads = torch.get_num_threads()
    x = torch.full((100_000,), 3e-39)  # denormal; past the size torch splits over threads
    with cpu_flushing_denormals("kit"):
        assert torch.get_num_threads() == 1
        assert bool(((x * 1.5) == 0).all())
    assert torch.get_num_threads() == threads
    assert bool(((x * 1.5) != 0).all())  # denormal results again


# --------------------------------------------------------------------------- memory


def test_memory_faults_fail_the_memory_checks(pytester: pytest.Pytester, kit_plugin: None) -> None:
    got = run_kit(pytester, ["kit-constant-memory", "kit-noop-peak-reset"], MEMORY)
    assert_failed(
        got["test_memory_stats_see_an_allocation[kit-constant-memory]"],
        "memory_stats().allocated (process) grew by 0 bytes",
    )
    assert_failed(
        got["test_peak_memory_resets[kit-constant-memory]"], "the peak (process) rose by 0 bytes"
    )
    assert got["test_memory_stats_see_an_allocation[kit-noop-peak-reset]"].outcome == "passed"
    # a reset that does nothing fails whichever window it was meant to start
    assert_failed(got["test_peak_memory_resets[kit-noop-peak-reset]"], "reset_peak_memory()")


# --------------------------------------------------------------------------- events


def test_event_faults_fail_the_event_check(pytester: pytest.Pytester, kit_plugin: None) -> None:
    backends = (
        "kit-zero-elapsed",
        "kit-reversed-elapsed",
        "kit-creation-stamped",
        "kit-elapsed-unsupported",
    )
    got = run_kit(pytester, backends, EVENTS)
    check = "test_events_time_known_work_in_order"
    assert_failed(got[f"{check}[kit-zero-elapsed]"], "e1->e2 (1 unit) timed 0.000 ms")
    assert_failed(got[f"{check}[kit-reversed-elapsed]"], "events out of order")
    assert_failed(got[f"{check}[kit-creation-stamped]"], "e1->e2 (1 unit) timed ", "host clock")
    # NotSupportedError from elapsed_time (not the new_event capability) is a failure
    assert_failed(got[f"{check}[kit-elapsed-unsupported]"], "NotSupportedError", "no timer")


# --------------------------------------------------------------------------- streams


def test_stream_faults_fail_their_stream_check(pytester: pytest.Pytester, kit_plugin: None) -> None:
    backends = (
        "kit-noop-wait-stream",
        "kit-noop-wait-event",
        "kit-noop-synchronize",
        "kit-same-stream",
        "kit-no-streams",
    )
    got = run_kit(pytester, backends, STREAMS)
    distinct, wait_stream, wait_event, sync = STREAMS
    assert_failed(got[f"{wait_stream}[kit-noop-wait-stream]"], "main.wait_stream did not order")
    for other in (distinct, wait_event, sync):
        assert got[f"{other}[kit-noop-wait-stream]"].outcome == "passed"
    assert_failed(got[f"{wait_event}[kit-noop-wait-event]"], "Stream.wait_event did not order")
    assert got[f"{wait_stream}[kit-noop-wait-event]"].outcome == "passed"
    assert_failed(got[f"{sync}[kit-noop-synchronize]"], "Stream.synchronize did not order")
    assert_failed(got[f"{distinct}[kit-same-stream]"], "new_stream() returned the current stream")
    # new_stream is the capability a device may lack: a skip with the backend's reason
    for check in STREAMS:
        assert got[f"{check}[kit-no-streams]"] == Outcome(
            "skipped", "Skipped: cpu: kit: this device runs one queue; there are no user streams"
        )


# --------------------------------------------------------------------------- kernels


def test_kernel_faults_fail_the_kernel_check(pytester: pytest.Pytester, kit_plugin: None) -> None:
    backends = (
        "kit-wrong-kernel",
        "kit-out-of-place-kernel",
        "kit-copying-unpack",
        "kit-reference-kernel",
        "kit-misnamed-kernel",
    )
    got = run_kit(pytester, backends, KERNELS)
    check = "test_kernel_matches_reference"
    assert_failed(
        got[f"{check}[kit-wrong-kernel-scale_accumulate@kit-wrong-kernel]"],
        "scale_accumulate (kit-wrong-kernel implementation), sample 0: result",
    )
    assert_failed(
        got[f"{check}[kit-out-of-place-kernel-scale_accumulate@kit-out-of-place-kernel]"],
        "scale_accumulate (kit-out-of-place-kernel implementation), sample 0: arguments after",
    )
    assert_failed(
        got[f"{check}[kit-copying-unpack-unpack_bucket@kit-copying-unpack]"],
        "unpack_bucket (kit-copying-unpack implementation), sample 0: results alias the inputs",
    )
    assert_failed(
        got[f"{check}[kit-reference-kernel-scale_accumulate@kit-reference-kernel]"],
        "registered the reference of scale_accumulate as its own implementation",
    )
    # not declared: reported as running the reference, never compared with itself
    assert got[f"{check}[kit-misnamed-kernel-scale_accumulate@reference]"] == Outcome(
        "skipped",
        "Skipped: kit-misnamed-kernel: scale_accumulate runs the reference "
        "(no kit-misnamed-kernel implementation)",
    )


def test_kernels_that_flush_small_values_fail_the_kernel_check(
    pytester: pytest.Pytester, kit_plugin: None
) -> None:
    """Outputs under 1e-6, or denormals, written as zero: every kernel check fails on them."""
    small, denormals = "kit-flush-small", "kit-flush-denormals"
    got = run_kit(pytester, [small, denormals], KERNELS)
    check = "test_kernel_matches_reference"
    for backend in (small, denormals):
        for kernel in ("pack_bucket", "unpack_bucket", "fp8_dequantize"):
            assert_failed(
                got[f"{check}[{backend}-{kernel}@{backend}]"],
                f"{kernel} ({backend} implementation), sample 0: result",
                "differ from the reference bit for bit",
            )
        assert_failed(
            got[f"{check}[{backend}-scale_accumulate@{backend}]"],
            f"scale_accumulate ({backend} implementation), sample 0: result",
            "differ from the reference by more than the bound",
        )
    # fp8_quantize writes integers, so flushing its outputs changes nothing (a pass);
    # reading the denormal block as zero gives other codes and exponents
    assert got[f"{check}[{small}-fp8_quantize@{small}]"].outcome == "passed"
    assert_failed(
        got[f"{check}[{denormals}-fp8_quantize@{denormals}]"],
        f"fp8_quantize ({denormals} implementation), sample 0: result",
        "differ from the reference bit for bit",
    )


def test_an_expected_kernel_that_runs_the_reference_fails(
    pytester: pytest.Pytester, kit_plugin: None
) -> None:
    got = run_kit(
        pytester, ["kit-misnamed-kernel"], KERNELS, expected_kernels=("scale_accumulate",)
    )
    assert_failed(
        got["test_kernel_matches_reference[kit-misnamed-kernel-scale_accumulate@reference]"],
        "scale_accumulate launches the reference: no implementation is registered under "
        "'kit-misnamed-kernel' (registered for: ",
        "kit-misnamed-kernels",
    )


# --------------------------------------------------------------------------- collectives


@pytest.mark.multiprocess
def test_collective_faults_fail_their_collective_check(
    pytester: pytest.Pytester, kit_plugin: None
) -> None:
    got = run_kit(pytester, ["kit-corrupt-collectives", "kit-partial-collectives"], COLLECTIVES)
    corrupt, partial = "kit-corrupt-collectives", "kit-partial-collectives"
    all_reduce, broadcast, all_gather, reduce_scatter = COLLECTIVES
    assert_failed(got[f"{all_reduce}[{corrupt}]"], "all_reduce on rank 0 gave [4.0, 7.0,")
    assert_failed(got[f"{broadcast}[{corrupt}]"], "broadcast on rank 0 gave [21.0,")
    assert_failed(got[f"{all_gather}[{corrupt}]"], "all_gather on rank 0 gave [2.0,")
    assert_failed(got[f"{reduce_scatter}[{corrupt}]"], "reduce_scatter on rank 0 gave [4.0,")
    # the intact ops of the same job pass
    assert got[f"{all_reduce}[{partial}]"].outcome == "passed"
    assert got[f"{broadcast}[{partial}]"].outcome == "passed"
    assert got[f"{reduce_scatter}[{partial}]"] == Outcome(
        "skipped", f"Skipped: declared unsupported by {partial}: reduce_scatter"
    )
    assert_failed(
        got[f"{all_gather}[{partial}]"],
        "all_gather raised NotSupportedError on rank 0",
        "does not declare it in Backend.unsupported_collectives",
    )
