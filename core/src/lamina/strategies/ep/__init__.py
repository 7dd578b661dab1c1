"""Expert parallelism (``"ep"``, issue 49, being built): a Mixture-of-Experts layer's
experts spread over the ranks of an ``ep`` axis, tokens moved to them.

Built so far: the dropless token dispatch and its plugin contract (:mod:`.dispatch`,
:mod:`.registry`: ``lamina_register_dispatchers``) and the experts of the transformers 5
layout, weights stacked per expert (:mod:`.experts`), and the MoE layers of a model found
by their stacked weights and confirmed by a forward (:mod:`.find`). The strategy that
distributes them is not registered yet.
"""

from lamina.strategies.ep.dispatch import AllToAllDispatcher, Dispatcher, ExpertGroup
from lamina.strategies.ep.experts import StackedExperts
from lamina.strategies.ep.find import MoeLayer, find_moe_layers
from lamina.strategies.ep.registry import dispatchers, resolve_dispatcher

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "ExpertGroup",
    "MoeLayer",
    "StackedExperts",
    "dispatchers",
    "find_moe_layers",
    "resolve_dispatcher",
]
