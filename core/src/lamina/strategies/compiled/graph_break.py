"""Where a capture stopped: the module and the operation, from torch.compile's error.

Dynamo's errors carry the user frames it was tracing (``real_stack``). The innermost one
inside a submodule's ``forward`` names that module (by its name in the model) and the
source line, the operation that could not be captured. :func:`graph_break_reason` turns
the error into the one line a fallback or a ``ConfigError`` shows.
"""

from __future__ import annotations

import os
import traceback

from torch import nn

from lamina.errors import failure_reason


def _forward_spans(model: nn.Module) -> list[tuple[str, str, str, int, int]]:
    """(module name, class name, file, first line, last line) of each module's
    ``forward``, innermost modules last."""
    spans = []
    for name, module in model.named_modules():
        code = getattr(type(module).forward, "__code__", None)
        if code is None:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        last = max(lines, default=code.co_firstlineno)
        spans.append((name, type(module).__name__, code.co_filename, code.co_firstlineno, last))
    return spans


def _frame_module(model: nn.Module, frame: traceback.FrameSummary) -> tuple[str, str] | None:
    """(module name, class name) whose ``forward`` holds ``frame`` (None: none does);
    where several modules share the class, the first, said to be one of them."""
    line = frame.lineno or 0
    names, found_cls = [], ""
    for name, cls, filename, first, last in _forward_spans(model):
        if frame.filename == filename and frame.name == "forward" and first <= line <= last:
            names.append(name or "(the model)")
            found_cls = cls
    if not names:
        return None
    shown = repr(names[0]) if len(names) == 1 else f"{names[0]!r} (one of {len(names)})"
    return shown, found_cls


def graph_break_reason(model: nn.Module, exc: BaseException) -> str:
    """One line: the module and source line where the capture stopped, then the error's
    own first line; without a frame inside the model, the error alone."""
    base = failure_reason(exc)
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, BaseException):  # the backend raised: its own error says why
        base = f"the compiler backend raised {failure_reason(inner)}"
    frames: list[traceback.FrameSummary] = list(getattr(exc, "real_stack", None) or [])
    for frame in reversed(frames):
        where = _frame_module(model, frame)
        if where is None:
            continue
        name, cls = where
        source = (frame.line or "").strip()
        place = f"{os.path.basename(frame.filename)}:{frame.lineno}"
        return f"graph break in module {name} ({cls}.forward, {place}: `{source}`): {base}"
    return base
