"""Micro-benchmarks run on every rank of a job (``lamina bench ...``).

:mod:`lamina.bench.collectives` is an nccl-tests-style sweep of the collectives on
whatever backend ``lamina.init()`` picks.
"""
