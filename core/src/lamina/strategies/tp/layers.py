"""The tensor-parallel plan of a model: which layer is split how (:class:`TensorPlan`).

A *region* is a run of the forward whose activations are split on one dimension across
the tensor-parallel ranks: it starts at column-parallel linears (weight rows split, so
each rank computes a slice of the features: a slice of the heads for attention) and ends
at row-parallel linears (weight columns split: each rank's output is a partial sum,
summed over the group). Embeddings are split by vocabulary (each rank looks up the ids
it holds, the lookups are summed), language-model heads by vocabulary (each rank computes
the logits of its slice, gathered at the end). With sequence parallelism, the activations
between regions are split on the sequence: gathered entering a region and reduce-
scattered leaving it, so norms and dropout run on ``1/tp`` of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: How a row-parallel linear's partial outputs are combined: summed (``sum``: all-reduce)
#: or summed and split on the sequence (``scatter``: reduce-scatter, sequence parallelism).
ROW_REDUCES: tuple[str, ...] = ("sum", "scatter")


@dataclass(frozen=True)
class Column:
    """A column-parallel linear: its output features cut into parts first (a fused q/k/v
    projection: 3 parts, each split across ranks): ``chunks`` equal ones, or ``sections``
    of these sizes (grouped-query attention's q, k, v); ``heads`` the most heads a part
    of its output is viewed as (0: none seen)."""

    linear: str
    chunks: int = 1
    heads: int = 0
    sections: tuple[int, ...] = ()

    def parts(self, features: int) -> tuple[int, ...]:
        """The sizes of the parts ``features`` output features are cut into."""
        if self.sections:
            return self.sections
        return (features // self.chunks,) * self.chunks


@dataclass(frozen=True)
class Row:
    """A row-parallel linear: its input features split, its output combined as
    ``reduce`` says (:data:`ROW_REDUCES`)."""

    linear: str
    reduce: str = "sum"


@dataclass(frozen=True)
class Region:
    """One split region: the module that holds it (where sequence parallelism gathers its
    input, ``entry``: the argument's position or keyword), its column- and row-parallel
    linears, and the shapes of its input and output activations (for the plan's bytes)."""

    module: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    entry: int | str = 0
    input_shape: tuple[int, ...] = ()
    output_shape: tuple[int, ...] = ()
    dtype: str = "float32"
    #: Whether ``module`` holds only this region's linears (a module of its own, as an
    #: attention or MLP module is; not a block that holds other layers too).
    owned: bool = True
    #: How many positional arguments ``module`` is called with (``entry`` among them).
    positional: int = 1

    def linears(self) -> tuple[str, ...]:
        """Every linear of the region, columns first."""
        return (*(c.linear for c in self.columns), *(r.linear for r in self.rows))


@dataclass(frozen=True)
class WrittenSize:
    """A size of a split dim the model's code writes whole (``split([q, kv, kv])``,
    ``view(b, s, self.heads, d)``): in ``module``, op ``op`` called with ``sizes``, the
    entry at ``position`` (-1: every entry, for a split) is divided by the tp size when
    it runs on this rank's slice."""

    module: str
    op: str
    sizes: tuple[int, ...]
    position: int = -1


@dataclass(frozen=True)
class VocabLayer:
    """A vocabulary-parallel embedding or head: ``module`` and its output's shape."""

    module: str
    output_shape: tuple[int, ...] = ()
    dtype: str = "float32"


@dataclass(frozen=True)
class TensorPlan:
    """The whole tensor-parallel plan (see the module docstring); ``source`` says where it
    came from (``derived from the captured graph`` or ``given``)."""

    size: int
    regions: tuple[Region, ...]
    embeddings: tuple[VocabLayer, ...] = ()
    heads: tuple[VocabLayer, ...] = ()
    sequence_parallel: bool = False
    #: The module whose input sequence parallelism splits first (the first block).
    split_at: str = ""
    #: Modules whose parameters run on sequence slices (norms): their gradients are
    #: summed over the group.
    sequence_modules: tuple[str, ...] = ()
    #: Why a linear stays replicated (module name -> reason).
    replicated: tuple[tuple[str, str], ...] = ()
    source: str = "derived from the captured graph"
    seq_dim: int = field(default=1)
    #: Whether ``split_at``'s input is an embedding's output itself (nothing added to it
    #: between, such as learned positions): the embedding can then give the slices.
    split_at_embedding: bool = False
    #: Modules whose parameters meet activations split inside a region (per-head q/k
    #: norms), with the dim of their input that is split (the heads'): whole on every
    #: rank, their gradients summed over the group.
    shared_modules: tuple[tuple[str, int], ...] = ()
    #: Sizes of split dims the model's code writes whole, scaled to the slice.
    written_sizes: tuple[WrittenSize, ...] = ()
    #: How a given plan differs from the one derived from the same forward.
    differences: tuple[str, ...] = ()

    def columns(self) -> dict[str, Column]:
        """Linear name -> its column split."""
        return {c.linear: c for r in self.regions for c in r.columns}

    def rows(self) -> dict[str, Row]:
        """Linear name -> its row split."""
        return {w.linear: w for r in self.regions for w in r.rows}

    def lines(self) -> tuple[str, ...]:
        """Canonical text of the plan: what pre-flight compares and ``--explain`` prints."""
        out = [f"tp={self.size} sequence_parallel={self.sequence_parallel} ({self.source})"]
        for emb in self.embeddings:
            out.append(f"embedding {emb.module}: vocabulary-parallel")
        for region in self.regions:
            cols = ", ".join(
                c.linear
                + (f" (x{c.chunks} chunks)" if c.chunks > 1 and not c.sections else "")
                + (f" (sections {'+'.join(map(str, c.sections))})" if c.sections else "")
                + (f" [{c.heads} heads]" if c.heads else "")
                for c in region.columns
            )
            rows = ", ".join(f"{r.linear} ({r.reduce})" for r in region.rows)
            out.append(f"region {region.module}: column {cols}; row {rows}")
        for head in self.heads:
            out.append(f"head {head.module}: vocabulary-parallel, logits gathered")
        if self.sequence_parallel:
            out.append(f"sequence split from {self.split_at} on dim {self.seq_dim}")
            if self.sequence_modules:
                out.append(f"on sequence slices: {', '.join(self.sequence_modules)}")
        if self.shared_modules:
            shared = ", ".join(
                f"{name} (input split on dim {dim})" for name, dim in self.shared_modules
            )
            out.append(f"whole, gradients summed: {shared}")
        for written in self.written_sizes:
            what = "its sizes" if written.position < 0 else f"size {written.position}"
            out.append(
                f"written sizes: {written.op}{list(written.sizes)} in {written.module}: "
                f"{what} divided by {self.size}"
            )
        for name, why in self.replicated:
            out.append(f"replicated {name}: {why}")
        for difference in self.differences:
            out.append(f"differs from the derived plan: {difference}")
        return tuple(out)
