"""Hugging Face ``Trainer`` on lamina's strategies (``pip install "lamina-core[hf]"``).

:class:`LaminaTrainer` is a ``transformers.Trainer`` whose model ``lamina.distribute``
distributes (instead of Accelerate's DDP); :func:`lamina_trainer` does the same for any
Trainer subclass (TRL's ``SFTTrainer``); :class:`LaminaParallelism` maps Accelerate's
``ParallelismConfig`` (plus ``pp`` and ``ep``) onto a lamina mesh and strategy list.
See ``docs/integrations/huggingface.md``.

Names load on first use (PEP 562): the mapping (:mod:`.parallelism`) imports neither
torch nor transformers; the Trainer classes (:mod:`.trainer`) import both.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lamina.integrations.hf.parallelism import LaminaParallelism, LaminaPlan
    from lamina.integrations.hf.trainer import LaminaTrainer, LaminaTrainerMixin, lamina_trainer

#: Each public name and the module that defines it.
_HOME = {
    "LaminaParallelism": "lamina.integrations.hf.parallelism",
    "LaminaPlan": "lamina.integrations.hf.parallelism",
    "LaminaTrainer": "lamina.integrations.hf.trainer",
    "LaminaTrainerMixin": "lamina.integrations.hf.trainer",
    "lamina_trainer": "lamina.integrations.hf.trainer",
}

__all__ = [
    "LaminaParallelism",
    "LaminaPlan",
    "LaminaTrainer",
    "LaminaTrainerMixin",
    "lamina_trainer",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
