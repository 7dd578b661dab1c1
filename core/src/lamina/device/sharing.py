"""One device per rank, and the test mode in which ranks share one.

An accelerator backend (``Backend.one_device_per_rank``: cuda, npu) gives each rank of a
host a device of its own; its collective library refuses two ranks on one device (NCCL:
"Duplicate GPU detected"). :func:`check_ranks_fit` turns that into one line naming both
numbers and the fixes, before any process group exists. ``$LAMINA_SHARE_DEVICE=1`` is a
testing aid, never a training mode: several ranks then share the host's devices
(``local_rank % count``) and their collectives run on gloo, which moves device tensors
through the host, so that multi-rank paths (streams, events, overlap, prefetch, trace
completion) run on a machine with one GPU. What gloo cannot do with device tensors
fails as gloo says, except torch's functional collectives (``DTensor.full_tensor`` /
``redistribute``, DCP of sharded tensors), whose coalesced all-gather gloo runs on device
memory as if it were the host's: a segfault (measured on an H200 with torch 2.11), so
this mode is not for them.
"""

from __future__ import annotations

import os

from lamina.device.backend import Backend
from lamina.errors import ConfigError

#: Set to 1 to let ranks share a device (tests only).
SHARE_DEVICE_ENV = "LAMINA_SHARE_DEVICE"


def share_device() -> bool:
    """Whether ``$LAMINA_SHARE_DEVICE`` turns the shared-device test mode on."""
    value = os.environ.get(SHARE_DEVICE_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ConfigError(
        f"{SHARE_DEVICE_ENV}={value!r} is not 0 or 1; set 1 only to test several ranks on one "
        "device (collectives on gloo), unset it to train"
    )


def check_ranks_fit(backend: Backend, ranks_on_host: int, devices: int) -> None:
    """ConfigError when ``ranks_on_host`` ranks would need more than the ``devices``
    visible, for a backend that gives each rank its own (unless the test mode is on)."""
    if not backend.one_device_per_rank or ranks_on_host <= devices or share_device():
        return
    visible = backend.visible_devices_env or "the visible-devices variable"
    raise ConfigError(
        f"{ranks_on_host} ranks on this host but {devices} {backend.name} device(s) visible: "
        f"each rank needs a device of its own; start --nproc-per-node {max(devices, 1)} (or "
        f"--nproc-per-node gpu: one rank per visible device), or make {ranks_on_host} devices "
        f"visible with {visible} ({SHARE_DEVICE_ENV}=1 lets ranks share a device for tests only)"
    )


def collective_backend(backend: Backend) -> str:
    """The torch.distributed backend of a job on ``backend``: its own, or gloo when ranks
    share a device in the test mode."""
    if backend.one_device_per_rank and share_device():
        return "gloo"
    return backend.collective_backend
