"""The parallelism a Hugging Face job asks for, as a lamina mesh and strategy list.

:class:`LaminaParallelism` holds the sizes Accelerate's ``ParallelismConfig`` names
(``dp_replicate``, ``dp_shard``, ``tp``) plus lamina's pipeline (``pp``) and the expert
axis Accelerate lacks (``ep``); :meth:`LaminaParallelism.from_accelerate` reads an
Accelerate config, and :meth:`LaminaParallelism.plan` maps the sizes onto the mesh
``lamina.init(mesh=...)`` builds and the strategies ``lamina.distribute`` composes on it.
Both are pure: no process group, no model, so they are unit tested one size at a time.

The mesh axes, outermost first, are ``pp``, ``dp`` (replicas), ``fsdp`` (shards) and
``tp`` (innermost, as in Accelerate's and torchtitan's meshes): ranks of one tensor-parallel
group are neighbours, and so share a host where they can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.errors import ConfigError

#: The mesh axis each size becomes (outermost first).
PP_AXIS, REPLICATE_AXIS, SHARD_AXIS, TP_AXIS = "pp", "dp", "fsdp", "tp"
#: The strategies lamina has today (``lamina.strategies.strategies()``), for the refusals.
AVAILABLE = "dp, zero3, hsdp, tp, pp"


@dataclass(frozen=True)
class LaminaPlan:
    """What :meth:`LaminaParallelism.plan` gives: the ``mesh`` to pass to
    ``lamina.init``, the ``strategy`` to pass to ``lamina.distribute`` (one name, or the
    names composed, outermost first) and, for ``hsdp`` alone, the axes it shards and
    replicates over (``shard``, ``replicate``; empty: the strategy's default)."""

    mesh: dict[str, int]
    strategy: str | tuple[str, ...]
    shard: tuple[str, ...] = ()
    replicate: tuple[str, ...] = ()

    @property
    def strategies(self) -> tuple[str, ...]:
        """The strategy names as a tuple (one or several)."""
        return (self.strategy,) if isinstance(self.strategy, str) else self.strategy

    def describe(self) -> str:
        """One line: ``['tp', 'zero3'] on mesh {'fsdp': 2, 'tp': 2}``."""
        named = self.strategy if isinstance(self.strategy, str) else list(self.strategy)
        return f"{named!r} on mesh {self.mesh}"


@dataclass(frozen=True)
class LaminaParallelism:
    """Sizes of each kind of parallelism; their product is the job's world size.

    ``dp_replicate``: whole replicas (DDP; with ``dp_shard`` HSDP's replicas);
    ``dp_shard``: ZeRO-3 / FSDP shards; ``tp``: tensor parallelism; ``pp``: pipeline
    stages; ``ep``: expert parallelism (lamina has no strategy for it yet: refused)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"LaminaParallelism {name}={value!r}: give a whole number >= 1 (1 turns it off)"
                )

    @classmethod
    def from_accelerate(cls, config: Any) -> LaminaParallelism:
        """The sizes of an Accelerate ``ParallelismConfig`` (any object with its
        ``*_size`` fields; a size left ``None`` counts as 1). Context parallelism
        (``cp_size``) and DeepSpeed's sequence parallelism (``sp_size``) have no lamina
        strategy yet: a size above 1 is refused in one line."""
        if isinstance(config, LaminaParallelism):
            return config

        def size(field: str) -> int:
            value = getattr(config, field, None)
            return 1 if value is None else value  # type: ignore[no-any-return]

        for field, what in (
            ("cp_size", "context-parallel"),
            ("sp_size", "sequence-parallel (DeepSpeed Ulysses)"),
        ):
            if size(field) != 1:
                raise ConfigError(
                    f"ParallelismConfig {field}={size(field)}: lamina has no {what} strategy yet "
                    f"(it has {AVAILABLE}); drop {field} (or set it to 1)"
                )
        return cls(
            dp_replicate=size("dp_replicate_size"),
            dp_shard=size("dp_shard_size"),
            tp=size("tp_size"),
            pp=size("pp_size"),
            ep=size("ep_size"),
        )

    @property
    def world_size(self) -> int:
        """The number of ranks these sizes take (their product)."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.ep

    def check_world(self, world_size: int) -> None:
        """ConfigError unless the sizes multiply to ``world_size``."""
        if self.world_size != world_size:
            raise ConfigError(
                f"{self} takes {self.world_size} rank(s) but the job has {world_size}; make "
                "dp_replicate x dp_shard x tp x pp the world size"
            )

    def plan(self) -> LaminaPlan:
        """The mesh and strategies for these sizes (see the table in
        ``docs/integrations/huggingface.md``):

        - ``dp_replicate`` only: ``"dp"`` on ``{"dp": R}``; nothing above 1: ``"dp"`` on
          ``{"dp": 1}`` (one process);
        - ``dp_shard`` only: ``"zero3"`` on ``{"fsdp": S}``;
        - ``dp_replicate`` x ``dp_shard``: ``"hsdp"`` on ``{"dp": R, "fsdp": S}``,
          sharding over ``fsdp`` and replicating over ``dp``;
        - ``tp`` with ``dp_shard``: ``["tp", "zero3"]`` on ``{"fsdp": S, "tp": T}``; with
          ``dp_replicate`` too (or alone) ``["tp", "hsdp"]`` on ``{"dp": R, "fsdp": S, "tp": T}``;
        - ``pp`` leads the list on the outermost axis: ``["pp", "zero3"]`` on
          ``{"pp": P, "fsdp": S}``, ``"pp"`` alone replicating its stages over ``dp``.

        ``ep`` above 1 is refused: lamina has no expert-parallel strategy yet."""
        if self.ep != 1:
            raise ConfigError(
                f"ep={self.ep}: lamina has no expert-parallel strategy yet (it has "
                f"{AVAILABLE}); drop ep (or set it to 1)"
            )
        replicas, shards, tp, pp = self.dp_replicate, self.dp_shard, self.tp, self.pp
        # replicas beside a tp split are HSDP with one shard each (as FSDP2 composes them)
        hsdp = replicas > 1 and (shards > 1 or (tp > 1 and pp == 1))
        mesh: dict[str, int] = {}
        if pp > 1:
            mesh[PP_AXIS] = pp
        if replicas > 1:
            mesh[REPLICATE_AXIS] = replicas
        if shards > 1 or hsdp:
            mesh[SHARD_AXIS] = shards
        if tp > 1:
            mesh[TP_AXIS] = tp
        names: list[str] = []
        if pp > 1:
            names.append("pp")
        if tp > 1:
            names.append("tp")
        if hsdp:
            names.append("hsdp")
        elif shards > 1:
            names.append("zero3")
        if not names:
            names.append("dp")
        if not mesh:
            mesh[REPLICATE_AXIS] = 1
        if names == ["hsdp"]:  # alone, hsdp's default axes are a topology's inter x intra
            return LaminaPlan(mesh, "hsdp", shard=(SHARD_AXIS,), replicate=(REPLICATE_AXIS,))
        return LaminaPlan(mesh, names[0] if len(names) == 1 else tuple(names))

    def __str__(self) -> str:
        sizes = (f"{n}={getattr(self, n)}" for n in ("dp_replicate", "dp_shard", "tp", "pp", "ep"))
        return f"LaminaParallelism({', '.join(sizes)})"


__all__ = ["LaminaParallelism", "LaminaPlan"]
