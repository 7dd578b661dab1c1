"""Shared helpers of the cuda backend tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from lamina_cuda.nvml_source import NvmlAnswers, load_answers

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def dgx_h100() -> NvmlAnswers:
    """Recorded NVML answers of a DGX H100 (8 GPUs, NVSwitch)."""
    return load_answers(FIXTURES / "nvml_dgx_h100.json")


@pytest.fixture
def pcie_4gpu() -> NvmlAnswers:
    """Recorded NVML answers of a 4-GPU PCIe server (two switches, two sockets)."""
    return load_answers(FIXTURES / "nvml_pcie_4gpu.json")


@pytest.fixture
def cuda_reason() -> str | None:
    """Why the cuda backend cannot run here (``None`` when a GPU is usable)."""
    from lamina_cuda.backend import cuda_unavailable_reason

    return cuda_unavailable_reason()
