"""Testing support for lamina and its backends: the multi-process harness and the
conformance kit (:mod:`lamina.testing.conformance`, a pytest plugin)."""

from lamina.testing.harness import RankFailure, RankTimeout, free_port, run_ranks

__all__ = ["RankFailure", "RankTimeout", "free_port", "run_ranks"]
