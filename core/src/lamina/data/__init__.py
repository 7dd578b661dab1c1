"""Data helpers that survive a resume: :class:`EpochSampler` hands each rank its share of
an epoch and re-partitions the rest of it on another world size."""

from lamina.data.sampler import EpochSampler

__all__ = ["EpochSampler"]
