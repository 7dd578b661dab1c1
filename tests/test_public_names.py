"""What a training loop or a backend imports comes from ``lamina`` and ``lamina.device``
(PEP 562: nothing loads torch until a name is used), and is the same object as the one at
its defining module's path, which keeps working."""

from __future__ import annotations

import subprocess
import sys

import lamina
import lamina.device
from lamina.checkpoint import CheckpointManager, seed_all
from lamina.comm.codecs import CastCodec, Codec, Fp8Codec, TwoPhaseCodec
from lamina.data import EpochSampler
from lamina.device.backend import Availability, Backend
from lamina.device.handle import DeviceHandle, Stream
from lamina.device.topology import Topology
from lamina.errors import ConfigError, LaminaError, MeshError, VerificationError
from lamina.strategies.codec_registry import codecs


def test_a_training_loop_imports_from_lamina() -> None:
    assert lamina.CheckpointManager is CheckpointManager
    assert lamina.seed_all is seed_all
    assert lamina.EpochSampler is EpochSampler
    assert (lamina.Codec, lamina.CastCodec, lamina.TwoPhaseCodec, lamina.Fp8Codec) == (
        Codec,
        CastCodec,
        TwoPhaseCodec,
        Fp8Codec,
    )
    assert lamina.codecs is codecs and "fp8" in lamina.codecs()
    for error in (lamina.ConfigError, lamina.MeshError, lamina.VerificationError):
        assert issubclass(error, lamina.LaminaError)
    assert (lamina.ConfigError, lamina.MeshError, lamina.LaminaError) == (
        ConfigError,
        MeshError,
        LaminaError,
    )
    assert lamina.VerificationError is VerificationError


def test_a_backend_author_imports_from_lamina_device() -> None:
    assert lamina.device.DeviceHandle is DeviceHandle
    assert lamina.device.Stream is Stream
    assert (lamina.device.Backend, lamina.device.Availability) == (Backend, Availability)
    assert lamina.device.Topology is Topology
    assert set(lamina.device.__all__) <= set(dir(lamina.device))
    for name in lamina.device.__all__:
        assert getattr(lamina.device, name) is not None


def test_every_public_name_loads_and_importing_them_needs_no_torch_until_used() -> None:
    code = (
        "import sys, lamina, lamina.device\n"
        "from lamina import ConfigError, LaminaError\n"
        "assert 'torch' not in sys.modules, 'lamina or its errors imported torch'\n"
        "for name in lamina.__all__: getattr(lamina, name)\n"
        "for name in lamina.device.__all__: getattr(lamina.device, name)\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"  # the names themselves do need torch
