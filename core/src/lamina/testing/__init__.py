"""Testing support for lamina and its backends: the multi-process harness, the count of
what crosses ``torch.distributed`` (:class:`WireCounter`) and the conformance kit
(:mod:`lamina.testing.conformance`, a pytest plugin)."""

from lamina.testing.harness import RankFailure, RankTimeout, free_port, run_ranks
from lamina.testing.wire import WireCounter, WireRecord

__all__ = ["RankFailure", "RankTimeout", "WireCounter", "WireRecord", "free_port", "run_ranks"]
