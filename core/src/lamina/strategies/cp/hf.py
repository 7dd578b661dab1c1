"""transformers models under context parallelism: their attention through torch's
``scaled_dot_product_attention`` with no mask built, and global position ids.

A transformers model builds its attention mask from the positions it sees; on a cp rank
those are a slice of the sequence (two, load-balanced), which it would read as packed
documents. :func:`use_context_attention` registers an attention implementation that is
transformers' own SDPA one with a mask function that builds none (the cp attention masks
by global position and document itself) and switches the model to it. transformers is
not imported unless the model comes from it.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

#: The attention implementation lamina registers with transformers.
IMPLEMENTATION = "lamina_context_parallel"


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing it)."""
    module = sys.modules.get("transformers")
    return module is not None and isinstance(model, module.PreTrainedModel)


def use_context_attention(model: nn.Module) -> None:
    """Switch a transformers model to :data:`IMPLEMENTATION` (see the module)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, sdpa_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(IMPLEMENTATION)
    else:
        model.config._attn_implementation = IMPLEMENTATION  # type: ignore[union-attr]
