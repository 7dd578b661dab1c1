"""Compiled execution with its declared fallback: ``torch.compile`` -> eager.

The model's own forward runs through ``torch.compile(forward, backend=...,
fullgraph=True)`` (the forward, not the module's ``__call__``: the module's hooks run
once, eagerly, around it). When
compiling or running the compiled forward raises, the module's buffers and the RNG
states are restored to what they were before the call, the failure is recorded on the
plan's ``forward`` node, and this and every later call run eagerly. (A failure can only
be undone completely on the first call, where it is expected; a later recompilation
that fails still falls back, but keeps whatever the failed call changed.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lamina.errors import ConfigError, failure_reason
from lamina.runtime.log import RunLog


def compile_backend_of(option: bool | str) -> str | None:
    """``compile=`` option -> torch.compile backend name (``True``: ``"inductor"``)."""
    if option is False or option is None:
        return None
    if option is True:
        return "inductor"
    if isinstance(option, str) and option:
        return option
    raise ConfigError(f"compile={option!r}: pass False, True or a torch.compile backend name")


class CompiledForward:
    """Calls ``forward`` (``module``'s own forward) compiled, falling back to eager on the
    first failure."""

    def __init__(
        self,
        module: nn.Module,
        forward: Callable[..., Any],
        backend: str,
        log: RunLog,
        node: str,
    ) -> None:
        self.module = module
        self.forward = forward
        self.backend = backend
        self.log = log
        self.node = node
        self.failed = False
        self.calls = 0
        self._compiled = torch.compile(forward, backend=backend, fullgraph=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The forward, compiled while that works."""
        if self.failed:
            return self.forward(*args, **kwargs)
        first = self.calls == 0
        saved = _snapshot(self.module) if first else None
        self.calls += 1
        try:
            return self._compiled(*args, **kwargs)
        except Exception as exc:
            if saved is not None:
                _restore(self.module, saved)
            self.failed = True
            self.log.fallback(self.node, "eager", failure_reason(exc))
            return self.forward(*args, **kwargs)


def _snapshot(module: nn.Module) -> tuple[list[torch.Tensor], torch.Tensor]:
    buffers = [b.detach().clone() for b in module.buffers()]
    return buffers, torch.get_rng_state()


def _restore(module: nn.Module, saved: tuple[list[torch.Tensor], torch.Tensor]) -> None:
    buffers, rng = saved
    with torch.no_grad():
        for buffer, value in zip(module.buffers(), buffers, strict=True):
            buffer.copy_(value)
    torch.set_rng_state(rng)
