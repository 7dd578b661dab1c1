"""Expert parallelism (``"ep"``): a Mixture-of-Experts layer's experts spread over the
ranks of an ``ep`` axis, tokens moved to them.

:mod:`.strategy` distributes a model; the dropless token dispatch and its plugin contract
(:mod:`.dispatch`, :mod:`.registry`: ``lamina_register_dispatchers``), the experts of the
transformers 5 layout, weights stacked per expert (:mod:`.experts`, :mod:`.layer`), the
MoE layers found by their stacked weights and confirmed by a forward (:mod:`.find`), the
gradient sync (:mod:`.grad_sync`), the load-balancing loss over the global batch
(:mod:`.aux_loss`) and the step's plan (:mod:`.plan_nodes`) are its parts.
"""

from lamina.strategies.ep.dispatch import AllToAllDispatcher, Dispatcher, ExpertGroup
from lamina.strategies.ep.experts import StackedExperts
from lamina.strategies.ep.find import MoeLayer, find_moe_layers
from lamina.strategies.ep.options import ExpertParallelOptions
from lamina.strategies.ep.registry import dispatchers, resolve_dispatcher
from lamina.strategies.ep.strategy import ExpertParallelStrategy

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "ExpertGroup",
    "ExpertParallelOptions",
    "ExpertParallelStrategy",
    "MoeLayer",
    "StackedExperts",
    "dispatchers",
    "find_moe_layers",
    "resolve_dispatcher",
]
