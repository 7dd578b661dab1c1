"""lamina's strategies in Lightning: :class:`LaminaFabricStrategy` for Fabric and
:class:`LaminaTrainerStrategy` for the Trainer.

Importing this package registers ``lamina_dp``, ``lamina_zero3``, ``lamina_hsdp``,
``lamina_tp``, ``lamina_tp_zero3`` and ``lamina_tp_hsdp`` in both of Lightning's strategy
registries, so ``Fabric(strategy="lamina_zero3")`` and ``Trainer(strategy="lamina_zero3")``
work after ``import lamina.integrations.lightning`` (Lightning discovers no third-party
strategy without an import). Pass an instance for a mesh or options of your own:
``LaminaTrainerStrategy(["tp", "zero3"], mesh={"fsdp": 2, "tp": 2},
example_inputs=(batch,))``.
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lamina.integrations.lightning.common import REGISTERED
from lamina.integrations.lightning.fabric import LaminaFabricStrategy
from lamina.integrations.lightning.trainer import LaminaTrainerStrategy

LaminaFabricStrategy.register_strategies(STRATEGY_REGISTRY)
LaminaTrainerStrategy.register_strategies(StrategyRegistry)

__all__ = ["REGISTERED", "LaminaFabricStrategy", "LaminaTrainerStrategy"]
