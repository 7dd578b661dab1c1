"""The backend conformance kit: behaviour every lamina backend must show.

A backend package runs it against itself with a three-line test file::

    from lamina.testing.conformance import BackendConformance

    class TestMyBackendConformance(BackendConformance):
        backends = ("mydevice",)         # omit to run against every installed backend

The ``lamina_backend`` fixture (from :mod:`lamina.testing.pytest_plugin`) skips with the
backend's own reason when it is unavailable here, and hardware-gated checks skip with a
reason that names what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from lamina.device.backend import Availability, Backend
from lamina.device.handle import DeviceHandle
from lamina.device.kernels import KernelLauncher
from lamina.device.topology import merge_host_topologies
from lamina.device.topology_file import load_topology, save_topology
from lamina.errors import NotSupportedError
from lamina.plugins import get_registry
from lamina.testing.harness import RankFailure, run_ranks

#: Qualified name a rank reports for a capability the backend lacks.
_NOT_SUPPORTED = f"{NotSupportedError.__module__}.{NotSupportedError.__qualname__}"

KernelSample = Callable[[torch.device], tuple[tuple[Any, ...], dict[str, Any]]]


def _pack_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen).to(device) for s in [(7, 3), (5,), (2, 2, 2), ()]]
    return (tensors,), {}


def _unpack_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    flat = torch.arange(40, dtype=torch.float32, device=device)
    return (flat, [torch.Size([3, 4]), torch.Size([10]), torch.Size([2, 3, 3])]), {}


def _scale_sample(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    dst, src = (torch.randn(1000, generator=gen).to(device) for _ in range(2))
    return (dst, src, 0.25), {}


#: Inputs for every built-in kernel; a plugin's own kernels bring their own checks.
KERNEL_SAMPLES: dict[str, KernelSample] = {
    "pack_bucket": _pack_sample,
    "unpack_bucket": _unpack_sample,
    "scale_accumulate": _scale_sample,
}


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return [_to_cpu(v) for v in value]
    return value


def _clone_args(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [_clone_args(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone_args(v) for v in value)
    return value


@contextmanager
def _skip_if_not_supported(handle: DeviceHandle) -> Iterator[None]:
    """Skip (with the backend's own reason) when the device lacks the capability."""
    try:
        yield
    except NotSupportedError as exc:
        pytest.skip(f"{handle.device_type}: {exc}")


def _all_reduce_rank(expected_backend: str) -> list[float]:
    import torch.distributed as dist

    import lamina

    runtime = lamina.init()
    assert runtime.backend.name == expected_backend, runtime.backend.name
    assert dist.get_backend() == runtime.backend.collective_backend
    value = torch.full((4,), float(runtime.rank + 1), device=runtime.device)
    dist.all_reduce(value)
    runtime.handle.synchronize()
    result: list[float] = value.cpu().tolist()
    lamina.shutdown()
    return result


class BackendConformance:
    """The contract checks; subclass it in a test module to run them (see module doc)."""

    #: Restrict to these backend names (None: every installed backend, or --lamina-backend).
    backends: ClassVar[tuple[str, ...] | None] = None

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
        with _skip_if_not_supported(lamina_handle):
            device = lamina_handle.device_for_local_rank(0)
            nbytes = 64 * 2**20
            lamina_handle.synchronize(device)
            before = lamina_handle.memory_stats(device)
            if before.peak is None and before.allocated is None:
                pytest.skip(f"{lamina_handle.device_type}: the runtime reports no memory figures")
            lamina_handle.reset_peak_memory(device)
            block = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            lamina_handle.synchronize(device)
            during = lamina_handle.memory_stats(device)
            assert during.scope == before.scope
            assert during.peak is not None and during.peak >= nbytes * 0.9
            if during.scope == "device" and before.allocated is not None:
                assert during.allocated is not None
                assert during.allocated - before.allocated >= nbytes
            del block
            lamina_handle.reset_peak_memory(device)
            after = lamina_handle.memory_stats(device)
            assert after.peak is not None and after.peak < during.peak

    # -- streams and events ------------------------------------------------------------
    def test_events_are_ordered_and_timed(self, lamina_handle: DeviceHandle) -> None:
        with _skip_if_not_supported(lamina_handle):
            device = lamina_handle.device_for_local_rank(0)
            start, end = lamina_handle.new_event(), lamina_handle.new_event()
            start.record()
            x = torch.randn(256, 256, device=device)
            for _ in range(8):
                x = x @ x.T / 256
            end.record()
            end.synchronize()
            assert start.query() and end.query()
            elapsed = start.elapsed_time(end)
            assert elapsed >= 0.0 and math.isfinite(elapsed)

    def test_streams_synchronize_and_wait(self, lamina_handle: DeviceHandle) -> None:
        with _skip_if_not_supported(lamina_handle):
            device = lamina_handle.device_for_local_rank(0)
            side = lamina_handle.new_stream(device)
            main = lamina_handle.current_stream(device)
            side.wait_stream(main)
            with lamina_handle.use_stream(side):
                on_side = torch.arange(1024, device=device, dtype=torch.float32) * 2
            main.wait_stream(side)
            assert float(on_side.sum().item()) == 1024 * 1023
            event = main.record_event()
            side.wait_event(event)
            side.synchronize()
            assert side.query()
            lamina_handle.synchronize(device)

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
        device = lamina_handle.device_for_local_rank(0)
        assert torch.float32 not in lamina_handle.supported_dtypes()
        x = torch.linspace(-2, 2, 101, device=device)
        for dtype in sorted(lamina_handle.supported_dtypes(), key=str):
            back = x.to(dtype).to(torch.float32)
            assert lamina_handle.supports(dtype)
            rel = ((back - x).abs().max() / x.abs().max()).item()
            assert rel <= 0.13, f"{dtype}: relative round-trip error {rel}"

    # -- kernels ---------------------------------------------------------------------------
    def test_kernels_match_reference(
        self, lamina_backend: Backend, lamina_handle: DeviceHandle
    ) -> None:
        registry = get_registry().kernels
        launcher = KernelLauncher(registry, lamina_backend.name)
        device = lamina_handle.device_for_local_rank(0)
        checked = 0
        for name in registry.names():
            if name not in KERNEL_SAMPLES:
                continue
            args, kwargs = KERNEL_SAMPLES[name](device)
            got = _to_cpu(launcher.launch(name, *_clone_args(args), **kwargs))
            want = _to_cpu(launcher.reference(name, *_clone_args(args), **kwargs))
            _assert_close(got, want, name)
            checked += 1
        assert checked == len(KERNEL_SAMPLES), "a built-in kernel is missing from the registry"

    # -- topology ------------------------------------------------------------------------
    def test_topology_json_round_trip(self, lamina_backend: Backend, tmp_path: Path) -> None:
        piece = lamina_backend.discover_host_topology(0, 1)
        assert piece.device_type == lamina_backend.device_type
        topology = merge_host_topologies([piece])
        path = tmp_path / "topology.json"
        save_topology(topology, path)
        assert load_topology(path) == topology

    # -- collectives -------------------------------------------------------------------
    @pytest.mark.timeout(180)
    def test_two_rank_all_reduce(
        self, lamina_backend: Backend, lamina_handle: DeviceHandle
    ) -> None:
        count = lamina_handle.device_count()
        if lamina_backend.device_type != "cpu" and count < 2:
            pytest.skip(f"{lamina_backend.name}: needs 2 devices for 2 ranks, {count} visible")
        try:
            results = run_ranks(
                _all_reduce_rank,
                2,
                args=(lamina_backend.name,),
                env={"LAMINA_BACKEND": lamina_backend.name},
                timeout=150,
            )
        except RankFailure as failure:
            if failure.error_type != _NOT_SUPPORTED:
                raise
            pytest.skip(f"{lamina_backend.name}: {failure.message}")
        assert results == [[3.0] * 4, [3.0] * 4]


def _assert_close(got: Any, want: Any, name: str) -> None:
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), name
        for g, w in zip(got, want, strict=True):
            _assert_close(g, w, name)
        return
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        return
    assert got == want, name
