"""``capture``: the captured graph of a model's forward, from the first path that works.

Paths are tried in order (``torch.export`` non-strict, ``torch.fx`` symbolic trace with
shape propagation, a module-hook trace of one real forward); each failure is recorded in
the result's ``fallbacks`` with its reason, and :class:`CaptureError` is raised only when
every requested path fails. The model's parameters, buffers, ``training`` flags and the
RNG states are the same after capture as before, whichever paths ran.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from lamina.errors import ConfigError, failure_reason
from lamina.graph.fingerprint import fingerprint_of
from lamina.graph.hook_trace import hook_path
from lamina.graph.metadata import (
    CAPTURE_METHODS,
    CapturedGraph,
    CaptureError,
    CaptureFallback,
    CaptureMethod,
)
from lamina.graph.params import ParamTable
from lamina.graph.paths import PathResult, export_path, fx_path
from lamina.graph.state import preserved

logger = logging.getLogger("lamina.graph")

_PATHS: dict[str, Callable[[nn.Module, tuple[Any, ...], dict[str, Any], ParamTable], PathResult]]
_PATHS = {"export": export_path, "fx": fx_path, "hooks": hook_path}


def _check_request(args: Any, methods: Sequence[str]) -> None:
    if not isinstance(args, tuple):
        raise ConfigError(
            f"capture: example args must be a tuple, got {type(args).__name__}; "
            "pass a single input as (x,)"
        )
    unknown = [m for m in methods if m not in CAPTURE_METHODS]
    if unknown or not methods:
        raise ConfigError(
            f"capture: methods must be a non-empty sequence drawn from {list(CAPTURE_METHODS)}, "
            f"got {list(methods)}"
        )


def capture(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    methods: Sequence[CaptureMethod] = CAPTURE_METHODS,
) -> CapturedGraph:
    """Capture ``model``'s forward on the example inputs ``model(*args, **kwargs)``.

    ``methods`` names the paths to try, in order. Raises :class:`CaptureError` (listing
    every path's reason) when none works, :class:`~lamina.errors.ConfigError` for a
    malformed request.
    """
    _check_request(args, methods)
    kwargs = dict(kwargs or {})
    table = ParamTable.of(model)
    fallbacks: list[CaptureFallback] = []
    for method in methods:
        try:
            with preserved(model):
                found = _PATHS[method](model, args, kwargs, table)
        except Exception as exc:
            fallbacks.append(CaptureFallback(method, failure_reason(exc)))
            logger.info("capture of %s: %s failed: %s", type(model).__name__, method, exc)
            continue
        return _assemble(method, tuple(fallbacks), found, table)
    reasons = "; ".join(f"{f.method}: {f.reason}" for f in fallbacks)
    raise CaptureError(
        f"capture of {type(model).__name__} failed on every path ({reasons}); make the "
        "forward traceable by one of them or check that the example inputs fit the model",
        tuple(fallbacks),
    )


def _assemble(
    method: CaptureMethod,
    fallbacks: tuple[CaptureFallback, ...],
    found: PathResult,
    table: ParamTable,
) -> CapturedGraph:
    first_use_order, unused = table.order(found.first_use)
    graph = CapturedGraph(
        method=method,
        fallbacks=fallbacks,
        nodes=found.nodes,
        param_names=table.names,
        param_shapes=dict(table.shapes),
        param_dtypes=dict(table.dtypes),
        first_use_order=first_use_order,
        tied=table.tied,
        unused=unused,
    )
    graph = dataclasses.replace(graph, fingerprint=fingerprint_of(graph))
    logger.debug("%s", graph.summary())
    return graph
