"""A model's class extended in place by a strategy's mixin: :func:`extend_class`.

``dp`` and ``zero3`` / ``hsdp`` keep the user's model object: its class becomes a
subclass of the strategy's mixin and of its own class, under its own name, so
``isinstance``, the model's methods and its ``state_dict()`` keys stay the model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)


def extend_class(
    module: nn.Module, mixin: type[M], attributes: Mapping[str, Any], key: str, state: object
) -> M:
    """``module`` itself, its class extended by ``mixin`` (with ``attributes`` added),
    carrying ``state`` as ``module.<key>``: plain state, not a submodule or buffer."""
    cls = type(module)
    # the model's own name (Hugging Face writes type(model).__name__ into a saved
    # config's "architectures"); its __module__ says where the extension comes from
    extended = type(cls.__name__, (mixin, cls), dict(attributes))
    extended.__qualname__ = cls.__qualname__
    module.__class__ = extended
    assert isinstance(module, mixin)
    module.__dict__[key] = state
    return module
