"""lamina-backend-cuda: NVIDIA GPUs for lamina (torch.cuda, NCCL, NVML topology, Triton kernels).

Installing the package registers the ``cuda`` backend through the ``lamina`` entry point;
nothing here imports torch.cuda, NVML or Triton until the backend is probed or used.
"""

from __future__ import annotations

from lamina_cuda.backend import CudaBackend

__all__ = ["CudaBackend", "__version__"]

__version__ = "0.1.0"
