"""Layer 1: the captured static graph of a model's forward.

:func:`capture` tries ``torch.export`` (non-strict), ``torch.fx`` and a module-hook trace
in turn and returns a :class:`CapturedGraph`: per-node shape/dtype/device metadata, the
order parameters are first used (hence the order their gradients become ready), tied and
unused parameters, and a fingerprint that is equal across processes for the same model
and inputs.
"""

from lamina.graph.capture import capture
from lamina.graph.fingerprint import canonical_description, fingerprint_of
from lamina.graph.metadata import (
    CAPTURE_METHODS,
    CapturedGraph,
    CaptureError,
    CaptureFallback,
    CaptureMethod,
    NodeInfo,
)

__all__ = [
    "CAPTURE_METHODS",
    "CaptureError",
    "CaptureFallback",
    "CaptureMethod",
    "CapturedGraph",
    "NodeInfo",
    "canonical_description",
    "capture",
    "fingerprint_of",
]
