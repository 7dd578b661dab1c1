"""Expert parallelism (``"ep"``, issue 49, being built): a Mixture-of-Experts layer's
experts spread over the ranks of an ``ep`` axis, tokens moved to them.

Built so far: the dropless token dispatch and its plugin contract (:mod:`.dispatch`,
:mod:`.registry`: ``lamina_register_dispatchers``) and the experts of the transformers 5
layout, weights stacked per expert (:mod:`.experts`). The strategy that finds MoE layers
in a model and distributes them is not registered yet.
"""

from lamina.strategies.ep.dispatch import AllToAllDispatcher, Dispatcher, ExpertGroup
from lamina.strategies.ep.experts import StackedExperts
from lamina.strategies.ep.registry import dispatchers, resolve_dispatcher

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "ExpertGroup",
    "StackedExperts",
    "dispatchers",
    "resolve_dispatcher",
]
