"""This rank's process groups for a ZeRO-3 / HSDP placement: :func:`shard_groups`.

Parameters are sharded over the placement's shard axes and replicated over its replica
axes (HSDP); the plan names the same groups by their global ranks and mesh axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lamina.errors import ConfigError
from lamina.strategies.context import StrategyContext
from lamina.strategies.contract import Placement as MeshPlacement
from lamina.strategies.zero3 import plan as plan_z3


@dataclass(frozen=True)
class ShardGroups:
    """The groups this rank shards and replicates over (see :func:`shard_groups`)."""

    #: This rank's shard group (None: the whole job), its global ranks, and this rank's
    #: slot in it (the shard it holds).
    group: dist.ProcessGroup | None
    shard_ranks: tuple[int, ...]
    rank: int
    #: The replica group and its global ranks (None and empty: plain ZeRO-3).
    replicate_group: dist.ProcessGroup | None
    replicas: tuple[int, ...]
    #: The same groups as the plan names them.
    plan: plan_z3.PlanGroups
    #: The group over every axis the strategy is placed on (None: the whole job): the
    #: setup broadcast's, from its first rank. Another strategy (``tp``) holds the rest.
    everyone_group: dist.ProcessGroup | None = None

    @property
    def world(self) -> int:
        """Ranks in the shard group: the shards of each unit."""
        return len(self.shard_ranks)


def shard_groups(ctx: StrategyContext, placement: MeshPlacement, strategy: str) -> ShardGroups:
    """This rank's shard and replica groups for ``placement`` on ``ctx``'s mesh
    (ConfigError when it shards over no axis)."""
    if not placement.shard:
        raise ConfigError(
            f"strategy {strategy!r} shards over no mesh axis (placement "
            f"{placement.describe()}); name at least one axis in shard=, or use 'dp'"
        )
    mesh = ctx.mesh
    group, shard_ranks = mesh.group_over(placement.shard)
    replicate_group: dist.ProcessGroup | None = None
    replicas: tuple[int, ...] = ()
    if placement.replicate:
        replicate_group, replicas = mesh.group_over(placement.replicate)
    placed = (*placement.shard, *placement.replicate)
    everyone_group, everyone = mesh.group_over(placed)
    return ShardGroups(
        group=group,
        shard_ranks=shard_ranks,
        rank=shard_ranks.index(dist.get_rank()),
        replicate_group=replicate_group,
        replicas=replicas,
        plan=plan_z3.PlanGroups(
            shard=shard_ranks,
            shard_axis=mesh.axes_label(placement.shard),
            replicate=replicas,
            replicate_axis=mesh.axes_label(placement.replicate) if replicas else "",
            everyone=everyone,
            everyone_axis=mesh.axes_label(placed),
        ),
        everyone_group=everyone_group,
    )
