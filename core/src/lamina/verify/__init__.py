"""Pre-flight cross-rank verification: a mismatch becomes an error on every rank, not a hang.

Each rank builds a :class:`Manifest` (canonical text lines per category: world, backend,
mesh, parameters, the strategy's own categories such as graph or shards, plan) and calls
:func:`preflight` once, before the first collective of step 1. Ranks compare digests;
when they differ every rank raises
the same :class:`~lamina.errors.VerificationError` naming the ranks and the first
differing line, and a rank that never arrives is named after ``$LAMINA_VERIFY_TIMEOUT``.
"""

from lamina.errors import VerificationError
from lamina.verify.diff import Difference, find_differences, format_mismatch
from lamina.verify.manifest import (
    CATEGORIES,
    Manifest,
    backend_lines,
    build_manifest,
    mesh_lines,
    parameter_lines,
    world_lines,
)
from lamina.verify.preflight import (
    DEFAULT_TIMEOUT,
    TIMEOUT_ENV,
    PreflightReport,
    preflight,
    verify_timeout,
)

__all__ = [
    "CATEGORIES",
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "Difference",
    "Manifest",
    "PreflightReport",
    "VerificationError",
    "backend_lines",
    "build_manifest",
    "find_differences",
    "format_mismatch",
    "mesh_lines",
    "parameter_lines",
    "preflight",
    "verify_timeout",
    "world_lines",
]
