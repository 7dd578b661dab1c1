"""``EpochSampler``: each rank's batches of a shuffled epoch, resumable on any world size.

An epoch is one permutation of ``range(dataset_len)`` drawn from ``seed + epoch``. The
job consumes it in global batches of ``world_size x batch_size`` indices: global batch
``k`` is ``perm[position : position + world_size * batch_size]``, and rank ``r`` takes
the ``r``-th slice of ``batch_size`` of it. The state is the epoch and the global
``position`` (indices the whole job consumed), not a per-rank offset, so a job resumed
on another number of ranks carries on from the same position and splits the rest of
the epoch among its ranks: no sample is repeated or dropped. The last global batch of
an epoch may be short; its indices are split as evenly as possible (a rank may get one
fewer, or none), and the next call starts the next epoch. With ``drop_last=True`` an
epoch ends instead when less than a full global batch is left (those indices are
skipped, as ``DistributedSampler(drop_last=True)`` skips them), so every batch is full.
"""

from __future__ import annotations

from typing import Any

import torch

from lamina.errors import ConfigError


class EpochSampler:
    """The batches of rank ``rank`` of ``world_size`` (see the module docstring); put
    :meth:`state_dict` into a checkpoint's ``extra`` and :meth:`load_state_dict` it on
    resume, whatever the new world size."""

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        for name, value, low in (
            ("dataset_len", dataset_len, 1),
            ("batch_size", batch_size, 1),
            ("world_size", world_size, 1),
            ("rank", rank, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"EpochSampler {name}={value!r}: give an int >= {low}")
        if rank >= world_size:
            raise ConfigError(f"EpochSampler rank={rank} is not below world_size={world_size}")
        if drop_last and dataset_len < world_size * batch_size:
            raise ConfigError(
                f"EpochSampler drop_last=True: dataset_len={dataset_len} holds no full "
                f"global batch of {world_size} x {batch_size}; lower batch_size or grow the data"
            )
        self.dataset_len, self.batch_size = dataset_len, batch_size
        self.drop_last = drop_last
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.position = 0, 0
        self._perm: torch.Tensor | None = None

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(self.dataset_len, generator=gen)
        return self._perm

    def next_batch(self) -> list[int]:
        """This rank's indices of the next global batch (the job's position advances by
        the whole global batch on every rank alike)."""
        left = self.dataset_len - self.position
        if left <= 0 or (self.drop_last and left < self.world_size * self.batch_size):
            self.epoch, self.position, self._perm = self.epoch + 1, 0, None
        perm = self._permutation()
        size = min(self.world_size * self.batch_size, self.dataset_len - self.position)
        share, extra = divmod(size, self.world_size)
        start = self.position + self.rank * share + min(self.rank, extra)
        mine = perm[start : start + share + (1 if self.rank < extra else 0)]
        self.position += size
        return [int(i) for i in mine]

    def state_dict(self) -> dict[str, Any]:
        """Where the job is in the data: epoch, global position, seed and sizes."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Carry on from ``state`` (saved on any world size); ConfigError when it is for
        another dataset or seed."""
        for key in ("dataset_len", "seed"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"EpochSampler state has {key}={state.get(key)!r} but this sampler "
                    f"{getattr(self, key)!r}: resume with the same dataset and seed"
                )
        self.epoch, self.position, self._perm = int(state["epoch"]), int(state["position"]), None
