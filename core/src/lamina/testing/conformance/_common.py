"""Shared pieces of the conformance kit: capability calls, copies and storage of arguments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from lamina.device.handle import DeviceHandle
from lamina.errors import NotSupportedError

_T = TypeVar("_T")

#: Qualified name a rank reports for a capability the backend lacks.
NOT_SUPPORTED = f"{NotSupportedError.__module__}.{NotSupportedError.__qualname__}"


# --------------------------------------------------------------------------- helpers


def capability(handle: DeviceHandle, call: Callable[[], _T]) -> _T:
    """``call()``: the one call of a check that a device may lack (NotSupportedError: skip)."""
    try:
        return call()
    except NotSupportedError as exc:
        pytest.skip(f"{handle.device_type}: {exc}")


def to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return [to_cpu(v) for v in value]
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def clone_args(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [clone_args(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clone_args(v) for v in value)
    if isinstance(value, dict):
        return {k: clone_args(v) for k, v in value.items()}
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def storage_of(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None where the device has none to show (XLA)."""
    try:
        ptr = int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return ptr or None


def aliasing_of(result: Any, inputs: Any) -> list[bool] | None:
    """For each tensor of ``result``: does it share storage with a tensor of ``inputs``?"""
    held = [storage_of(t) for t in tensors_in(inputs)]
    out = [storage_of(t) for t in tensors_in(result)]
    if None in held or None in out:
        return None
    return [ptr in held for ptr in out]
