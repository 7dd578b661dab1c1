"""torch dtypes by their short names (``"bfloat16"``), as plans, layouts and traces store them."""

from __future__ import annotations

import torch

from lamina.errors import ConfigError


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ConfigError for a name torch does not have."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}; use a torch dtype name such as 'float32'")
    return dtype
