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
reference, and four collectives on two ranks return the right numbers.

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
from lamina.testing.conformance._kernels import KERNEL_SAMPLES, KernelSample
from lamina.testing.conformance._kit import BackendConformance

__all__ = [
    "COLLECTIVES",
    "KERNEL_SAMPLES",
    "BackendConformance",
    "CollectiveRun",
    "KernelSample",
    "expected_collective",
    "run_collectives",
]
