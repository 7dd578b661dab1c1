"""The candidates ``lamina.distribute(model, "auto")`` chooses among (torch-free).

A :class:`Candidate` is one way to distribute the model on the job's mesh: the
strategies (one, or a composition), the mesh axes each takes, and its options (a lossy
codec on the wire, the pipeline's microbatches). :func:`candidates_for` lists every one
that applies to a mesh, outermost axis first:

- one axis of ``W`` ranks: ``dp``, ``zero3``, ``tp`` and ``pp`` over all of it;
- two axes (``outer`` x ``inner``, as the topology mesh ``inter`` x ``intra``): ``dp``
  and ``zero3`` over both; ``hsdp`` sharding over ``inner``, replicating over ``outer``;
  ``tp`` over ``inner`` composed with ``zero3`` over ``outer``; ``pp`` over ``outer``
  replicated (``dp``) or sharded (``zero3``) over ``inner``. Fast links carry the traffic
  that grows with the model (tensor parallelism's per-layer collectives, shards), the
  slow ones the least (pipeline transfers, replicas' gradients);
- more axes: ``dp`` and ``zero3`` over all of them; ``tp`` on an axis named ``tp`` with
  ``zero3`` over the others; ``pp`` on an axis named ``pp``, replicated or sharded over
  the others.

With ``experts`` (the model has Mixture-of-Experts layers) expert parallelism too:
``ep`` alone over one axis; over either axis of two, with ``zero3`` over the other; over
an axis named ``ep`` with ``zero3`` over the others. Each ep rank holds its share of the
experts and takes its own rows.

With ``context`` (the model's attention sees a long sequence: :mod:`lamina.auto.choose`)
context parallelism too: ``cp`` over the one axis, over the inner axis of two, or over an
axis named ``cp``, each composed with ``zero3`` over every axis (the sharder spans the cp
ranks, whose parameters are whole). A cp group takes one data replica's batch and splits
its sequences, so a global batch of fewer rows than ranks can still be trained.

Axes of one rank are left out of the choice (the strategy that replicates takes them).

With ``allow_lossy`` ``dp`` also runs with each lossy codec (bf16, fp8) on its buckets.
Whether a candidate fits the model (a chain of blocks to cut, a batch to split into
microbatches) is the predictor's to say.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

#: Codecs tried with ``allow_lossy=True`` and the bytes they send per fp32 byte.
LOSSY_CODECS: dict[str, float] = {"bf16": 0.5, "fp8": 0.25}
#: The pipeline schedule the candidates run (its bubble: ``(p - 1) / (m + p - 1)``).
PIPELINE_SCHEDULE = "1f1b"


@dataclass(frozen=True)
class Use:
    """One strategy of a candidate and the mesh axes it shards and replicates over."""

    strategy: str
    shard: tuple[str, ...] = ()
    replicate: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """One way to distribute the model (see the module)."""

    uses: tuple[Use, ...]
    #: The mesh: (axis, size), outermost first.
    mesh: tuple[tuple[str, int], ...]
    codec: str | None = None
    #: Microbatches per step of a pipelined candidate (0: not pipelined).
    microbatches: int = 0

    @property
    def strategies(self) -> tuple[str, ...]:
        """The strategy names, as ``lamina.distribute`` takes them."""
        return tuple(u.strategy for u in self.uses)

    @property
    def label(self) -> str:
        """``dp``, ``hsdp``, ``tp(intra)+zero3(inter)``, ``dp+fp8``: what and where (the
        axes only where the mesh has two axes of several ranks)."""
        sizes = dict(self.mesh)

        def where(axes: tuple[str, ...]) -> str:
            shown = [a for a in axes if sizes[a] > 1]
            return f"({'+'.join(shown)})" if shown and several else ""

        several = sum(1 for _, size in self.mesh if size > 1) > 1
        parts = []
        for use in self.uses:
            if use.strategy in ("dp", "hsdp") or (use.strategy == "zero3" and len(self.uses) == 1):
                parts.append(use.strategy)
            elif use.strategy == "pp" and len(self.uses) == 1:
                parts.append(f"pp{where(use.shard)}")
                if any(sizes[a] > 1 for a in use.replicate):
                    parts.append(f"dp{where(use.replicate)}")
            else:
                parts.append(f"{use.strategy}{where(use.shard)}")
        label = "+".join(parts)
        return f"{label}+{self.codec}" if self.codec else label

    def size(self, axes: Sequence[str]) -> int:
        """Ranks along ``axes`` of the mesh."""
        sizes = dict(self.mesh)
        return math.prod(sizes[a] for a in axes)

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return math.prod(s for _, s in self.mesh)

    def use(self, strategy: str) -> Use | None:
        """The use of ``strategy`` (None: not part of this candidate)."""
        return next((u for u in self.uses if u.strategy == strategy), None)

    @property
    def tp_degree(self) -> int:
        """Ranks one layer is split over (1: no tensor parallelism)."""
        tp = self.use("tp")
        return self.size(tp.shard) if tp else 1

    @property
    def pp_degree(self) -> int:
        """Pipeline stages (1: not pipelined)."""
        pp = self.use("pp")
        return self.size(pp.shard) if pp else 1

    @property
    def cp_degree(self) -> int:
        """Ranks one sequence is split over (1: no context parallelism)."""
        cp = self.use("cp")
        return self.size(cp.shard) if cp else 1

    @property
    def ep_degree(self) -> int:
        """Ranks an MoE layer's experts are spread over (1: no expert parallelism)."""
        ep = self.use("ep")
        return self.size(ep.shard) if ep else 1

    @property
    def data_replicas(self) -> int:
        """Ranks groups that each take their own part of the global batch."""
        return self.world_size // (self.tp_degree * self.pp_degree * self.cp_degree)

    def batch_axes(self) -> tuple[str, ...]:
        """The axes the data replicas lie along (outside tp, pp and cp)."""
        taken = {a for s in ("tp", "pp", "cp") if (u := self.use(s)) for a in u.shard}
        return tuple(a for a, _ in self.mesh if a not in taken)

    @property
    def sharder(self) -> Use | None:
        """The use that shards parameters (zero3 or hsdp), if any."""
        return next((u for u in self.uses if u.strategy in ("zero3", "hsdp")), None)

    @property
    def shard_degree(self) -> int:
        """Ranks the sharder splits each parameter over (1: none)."""
        sharder = self.sharder
        return self.size(sharder.shard) if sharder else 1

    def sync_axes(self) -> tuple[str, ...]:
        """The axes gradients are averaged over outside tensor and pipeline parallelism."""
        taken = {a for s in ("tp", "pp") if (u := self.use(s)) for a in u.shard}
        return tuple(a for a, _ in self.mesh if a not in taken)

    def to_json(self) -> dict[str, object]:
        """Plain data."""
        return {
            "label": self.label,
            "strategies": list(self.strategies),
            "placement": {
                u.strategy: {"shard": list(u.shard), "replicate": list(u.replicate)}
                for u in self.uses
            },
            "codec": self.codec,
            "microbatches": self.microbatches,
        }


def candidates_for(
    mesh: Mapping[str, int] | Sequence[tuple[str, int]],
    *,
    allow_lossy: bool = False,
    microbatches: int = 0,
    context: bool = False,
    experts: bool = False,
) -> list[Candidate]:
    """Every candidate on ``mesh`` (see the module); ``microbatches`` per pipelined step
    (0: twice the stages); ``context``: context parallelism too; ``experts``: expert
    parallelism too."""
    axes = tuple(mesh.items()) if isinstance(mesh, Mapping) else tuple(mesh)
    if not axes or any(size < 1 for _, size in axes):
        raise ValueError(f"a mesh of positive axis sizes is needed, got {axes}")
    trivial = tuple(a for a, size in axes if size == 1)
    real = tuple((a, size) for a, size in axes if size > 1)
    if not real:  # one rank: nothing to distribute but the plain step
        return [Candidate((Use("dp", replicate=tuple(a for a, _ in axes)),), axes)]
    found = _on(real, allow_lossy, microbatches)
    if context:
        found += _context(real)
    if experts:
        found += _experts(real)
    out = [_placed(c, axes, trivial) for c in found]
    return [c for c in out if c is not None]


def _context(axes: tuple[tuple[str, int], ...]) -> list[Candidate]:
    """Context parallelism on a mesh whose every axis holds two ranks or more: over the
    one axis, the inner of two, or the axis named ``cp``; ``zero3`` over every axis."""
    names = tuple(a for a, _ in axes)
    if len(axes) == 1:
        over: tuple[str, ...] = names
    elif len(axes) == 2:
        over = (names[1],)
    elif "cp" in names:
        over = ("cp",)
    else:
        return []
    return [Candidate((Use("cp", shard=over), Use("zero3", shard=names)), axes)]


def _experts(axes: tuple[tuple[str, int], ...]) -> list[Candidate]:
    """Expert parallelism on a mesh whose every axis holds two ranks or more: over the one
    axis alone; over either axis of two, with ``zero3`` over the other (experts spread
    across the hosts and sharded inside them, or the reverse); over an axis named ``ep``
    with ``zero3`` over the others. The ep axis is a data axis: each of its ranks takes
    its own rows."""
    names = tuple(a for a, _ in axes)
    if len(axes) == 1:
        return [Candidate((Use("ep", shard=names),), axes)]
    pairs: list[tuple[str, tuple[str, ...]]]
    if len(axes) == 2:
        pairs = [(names[1], (names[0],)), (names[0], (names[1],))]
    elif "ep" in names:
        pairs = [("ep", tuple(a for a in names if a != "ep"))]
    else:
        return []
    return [
        Candidate((Use("ep", shard=(over,)), Use("zero3", shard=rest)), axes)
        for over, rest in pairs
    ]


def _placed(
    c: Candidate, axes: tuple[tuple[str, int], ...], trivial: tuple[str, ...]
) -> Candidate | None:
    """``c`` on the whole mesh: its axes of one rank replicated by the strategy that
    replicates (or shards) the rest; None for tensor parallelism alone, which places
    nothing else."""
    if not trivial:
        return c
    first = c.uses[-1]
    if first.strategy == "tp":
        return None
    widened = Use(first.strategy, first.shard, (*first.replicate, *trivial))
    return Candidate((*c.uses[:-1], widened), axes, c.codec, c.microbatches)


def _on(axes: tuple[tuple[str, int], ...], allow_lossy: bool, microbatches: int) -> list[Candidate]:
    """The candidates of a mesh whose every axis holds two ranks or more."""
    names = tuple(a for a, _ in axes)
    world = math.prod(s for _, s in axes)
    out = [
        Candidate((Use("dp", replicate=names),), axes),
        Candidate((Use("zero3", shard=names),), axes),
    ]
    if allow_lossy:
        out += [
            Candidate((Use("dp", replicate=names),), axes, codec=codec) for codec in LOSSY_CODECS
        ]

    def pipelined(stages: int) -> int:
        return microbatches or 2 * stages

    if len(axes) == 1:
        out.append(Candidate((Use("tp", shard=names),), axes))
        out.append(Candidate((Use("pp", shard=names),), axes, microbatches=pipelined(world)))
    elif len(axes) == 2:
        (outer, outer_size), (inner, _) = axes
        stages = pipelined(outer_size)
        out += [
            Candidate((Use("hsdp", shard=(inner,), replicate=(outer,)),), axes),
            Candidate((Use("tp", shard=(inner,)), Use("zero3", shard=(outer,))), axes),
            Candidate((Use("pp", shard=(outer,), replicate=(inner,)),), axes, microbatches=stages),
            Candidate(
                (Use("pp", shard=(outer,)), Use("zero3", shard=(inner,))),
                axes,
                microbatches=stages,
            ),
        ]
    else:  # three axes or more: tp and pp where the mesh names their axes
        out += _on_named_axes(axes, pipelined)
    return out


def _on_named_axes(
    axes: tuple[tuple[str, int], ...], pipelined: Callable[[int], int]
) -> list[Candidate]:
    """On a mesh of three axes or more: ``tp`` on an axis named ``tp`` and ``pp`` on one
    named ``pp``, the rest replicated or sharded."""
    names = tuple(a for a, _ in axes)
    sizes = dict(axes)
    out = []
    rest_tp = tuple(a for a in names if a != "tp")
    rest_pp = tuple(a for a in names if a != "pp")
    if "tp" in sizes:
        out.append(Candidate((Use("tp", shard=("tp",)), Use("zero3", shard=rest_tp)), axes))
    if "pp" in sizes:
        stages = pipelined(sizes["pp"])
        out.append(
            Candidate((Use("pp", shard=("pp",), replicate=rest_pp),), axes, microbatches=stages)
        )
        out.append(
            Candidate(
                (Use("pp", shard=("pp",)), Use("zero3", shard=rest_pp)), axes, microbatches=stages
            )
        )
    return out


__all__ = ["LOSSY_CODECS", "PIPELINE_SCHEDULE", "Candidate", "Use", "candidates_for"]
