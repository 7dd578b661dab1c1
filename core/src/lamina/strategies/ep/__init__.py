"""Expert parallelism (``"ep"``, issue 49, being built): a Mixture-of-Experts layer's
experts spread over the ranks of an ``ep`` axis, tokens moved to them.

Built so far: the dropless token dispatch (:mod:`.dispatch`) and the experts of the
transformers 5 layout, weights stacked per expert (:mod:`.experts`). The strategy that
finds MoE layers in a model and distributes them is not registered yet.
"""

from lamina.strategies.ep.dispatch import AllToAllDispatcher, ExpertGroup
from lamina.strategies.ep.experts import StackedExperts

__all__ = ["AllToAllDispatcher", "ExpertGroup", "StackedExperts"]
