"""The cuda backend's availability, registration, vendor versions and handle."""

from __future__ import annotations

import pytest
import torch

from lamina.plugins import get_registry
from lamina_cuda.backend import CudaBackend
from lamina_cuda.plugin import triton_unusable_reason


def test_backend_identity() -> None:
    backend = CudaBackend()
    assert (backend.name, backend.priority) == ("cuda", 100)
    assert (backend.device_type, backend.collective_backend) == ("cuda", "nccl")


def test_availability_names_what_is_missing_and_the_fix() -> None:
    availability = CudaBackend().availability()
    if torch.version.cuda is None:
        assert not availability.available
        assert availability.reason == (
            f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
        )
    elif not torch.cuda.is_available():
        assert not availability.available
        assert availability.reason.startswith("no CUDA device visible to torch")
        assert "CUDA_VISIBLE_DEVICES" in availability.reason
        assert "nvidia-smi" in availability.reason
    else:
        assert availability.available
        assert f"{torch.cuda.device_count()} CUDA device(s)" in availability.reason


def test_hidden_devices_are_named_in_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build: no device check to run")
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is already initialized in this process; the mask cannot change")
    import subprocess
    import sys

    code = "from lamina_cuda.backend import CudaBackend; print(CudaBackend().availability())"
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "CUDA_VISIBLE_DEVICES=''" in out.stdout, out.stderr


def test_registered_through_the_entry_point() -> None:
    registry = get_registry()
    entry = registry.backends["cuda"]
    assert isinstance(entry.backend, CudaBackend)
    assert entry.plugin == "cuda"
    assert registry.records["cuda"].status == "loaded"
    assert entry.availability == CudaBackend().availability()


def test_vendor_versions_without_importing() -> None:
    versions = CudaBackend().vendor_versions()
    assert versions["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert "nvidia-ml-py" in versions  # a dependency of the package
    assert set(versions) <= {"torch", "nvidia-ml-py", "triton"}


def test_triton_kernels_registered_only_when_usable() -> None:
    reason = triton_unusable_reason()
    impls = get_registry().kernels.backends_for("scale_accumulate")
    if reason is None:
        assert "cuda" in impls
    else:
        assert "cuda" not in impls
        assert "triton" in reason or "CUDA" in reason


def test_handle_on_a_gpu(cuda_reason: str | None) -> None:
    if cuda_reason is not None:
        pytest.skip(f"cuda unavailable: {cuda_reason}")
    handle = CudaBackend().handle()
    assert handle.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    count = handle.device_count()
    assert handle.device_for_local_rank(count + 1) == torch.device("cuda", 1 % count)
    dtypes = handle.supported_dtypes()
    assert torch.float16 in dtypes
    assert (torch.bfloat16 in dtypes) == torch.cuda.is_bf16_supported()
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    assert (torch.float8_e4m3fn in dtypes) == fp8
    stats = handle.memory_stats()
    assert stats.scope == "device" and stats.allocated is not None
    with pytest.raises(ValueError, match="'cuda' devices"):
        handle.memory_stats(torch.device("cpu"))
    stream = handle.new_stream()
    start, end = handle.new_event(), handle.new_event()
    start.record(stream)
    end.record(stream)
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(TypeError, match="CudaEvent"):
        stream.wait_event(object())  # type: ignore[arg-type]
