"""The backend conformance kit: behaviour every lamina backend must show.

A backend package runs it against itself with a three-line test file::

    from lamina.testing.conformance import BackendConformance

    class TestMyBackendConformance(BackendConformance):
        backends = ("mydevice",)         # omit to run against every installed backend

The fixtures come from :mod:`lamina.testing.pytest_plugin`: ``lamina_backend`` skips with
the backend's own reason when it is unavailable here. Each check observes behaviour a
stub cannot fake: memory figures must move by the bytes allocated, events must time work
the host clock timed too, a stream wait must hold back a read until a long write on
another stream has landed, kernels run the backend's own implementation against the
reference (bit for bit, but ``scale_accumulate`` within what a fused multiply-add may
change; samples hold outputs under 1e-6, denormals and ``-0.0``), reduced-precision
dtypes round trip within half an ulp, and four collectives on two ranks return the
right numbers.

A :class:`~lamina.errors.NotSupportedError` skips a check only when it comes from the
one call that may legitimately lack support (``memory_stats``/``reset_peak_memory``,
``new_event``, ``new_stream``, a multi-rank launch in ``prepare_process``); raised
anywhere else it fails the check. A collective the backend declares in
:attr:`~lamina.device.backend.Backend.unsupported_collectives` is skipped as declared.
"""

from lamina.testing.conformance._collectives import (
    COLLECTIVES,
    CollectiveRun,
    expected_collective,
    run_collectives,
)
from lamina.testing.conformance._compare import assert_same, assert_within
from lamina.testing.conformance._kernels import (
    KERNEL_COMPARISONS,
    KERNEL_SAMPLES,
    KernelComparison,
    KernelSample,
    bit_for_bit,
    multiply_add_bound,
)
from lamina.testing.conformance._kit import (
    MANTISSA_BITS,
    BackendConformance,
    cpu_flushing_denormals,
    round_trip_bound,
)

__all__ = [
    "COLLECTIVES",
    "KERNEL_COMPARISONS",
    "KERNEL_SAMPLES",
    "MANTISSA_BITS",
    "BackendConformance",
    "CollectiveRun",
    "KernelComparison",
    "KernelSample",
    "assert_same",
    "assert_within",
    "bit_for_bit",
    "cpu_flushing_denormals",
    "expected_collective",
    "multiply_add_bound",
    "round_trip_bound",
    "run_collectives",
]
