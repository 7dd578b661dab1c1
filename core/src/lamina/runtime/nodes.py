"""The typed facts of each kind of execution-plan node.

A node's ``detail`` is one of these frozen dataclasses, chosen by its kind: what an engine
is built from and what the simulator and the pre-flight check read. Nothing is read back
from a label (labels are for people) or from text: JSON exists only at the edges
(``lamina plan --json``, run logs) and reads back into these same types
(:mod:`lamina.runtime.plan_json`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Why a collective node runs.
#: ``gradient``: the mean gradient of a DP bucket (all-reduce) or a ZeRO-3 unit
#: (reduce-scatter into the shards); ``replicate``: the mean of a unit's shard gradient
#: across HSDP replicas; ``unused``: DP's all-reduce of gradients a captured forward did not
#: use, with their flags; ``broadcast``: rank 0's state at wrap time or buffers per step;
#: ``activation``: tensor parallelism's collectives on a layer's activations (or their
#: gradients) inside the step.
CollectivePurpose = Literal["gradient", "replicate", "unused", "broadcast", "activation"]
COLLECTIVE_PURPOSES: tuple[str, ...] = (
    "gradient",
    "replicate",
    "unused",
    "broadcast",
    "activation",
)
#: How long a gather holds a unit: its forward, the whole forward, or its backward.
GatherSpan = Literal["forward", "whole_forward", "backward"]
GATHER_SPANS: tuple[str, ...] = ("forward", "whole_forward", "backward")
#: What a pipeline transfer carries.
TransferPayload = Literal["activation", "gradient"]
TRANSFER_PAYLOADS: tuple[str, ...] = ("activation", "gradient")


@dataclass(frozen=True)
class AlgorithmFact:
    """The algorithm a collective runs and every runnable algorithm's predicted seconds
    (what the cost model chose it from)."""

    name: str
    chunks: int = 1
    predictions: tuple[tuple[str, float], ...] = ()

    def describe(self) -> str:
        """``hierarchical`` or ``pipelined x4 chunks``."""
        return self.name + (f" x{self.chunks} chunks" if self.chunks > 1 else "")

    def predicted(self) -> str:
        """``flat=1.234ms hierarchical=0.812ms`` (empty without predictions)."""
        return " ".join(f"{name}={seconds * 1e3:.3f}ms" for name, seconds in self.predictions)


@dataclass(frozen=True)
class CodecFact:
    """The codec a collective's payload travels in.

    ``scope``: ``all`` (the whole collective), ``inter`` (only the inter-host phase of a
    hierarchical or pipelined all-reduce) or ``replicas`` (HSDP's replica all-reduce);
    ``residual_bytes``: the error-feedback memory it keeps on each rank (0 without).
    """

    name: str
    scope: str = "all"
    error_feedback: bool = False
    residual_bytes: int = 0


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient lives in a collective's flat buffer: ``name``,
    ``shape`` and the element ``offset`` (a DP bucket's slots are what its reducer
    allocates; the unused-gradient all-reduce's are its parameters, packed)."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Compute:
    """A forward, backward or optimizer node: of ``unit`` (``""``: the whole model), of a
    pipeline ``stage`` and ``microbatch`` where they apply. A forward records how its
    graph was captured (``capture``) and runs (``mode``: ``eager`` or
    ``compiled:<backend>``). A pipeline stage's node also names the pipeline ``rank``
    running it, its predicted ``seconds`` (from the cut's measured times), which the
    simulator schedules, and the stage's parameter elements (``params``)."""

    unit: str = ""
    stage: int | None = None
    microbatch: int | None = None
    capture: str = ""
    mode: str = ""
    rank: int | None = None
    seconds: float | None = None
    params: int | None = None


@dataclass(frozen=True)
class Collective:
    """A collective node's facts beyond its :class:`~lamina.runtime.plan.CollectiveSpec`
    (op, dtype, bytes, group): why it runs and what it serves, the primitive and algorithm
    it runs with, and its codec (None: uncompressed).

    ``bucket`` is the DP bucket index, ``unit`` the ZeRO-3 unit, ``params`` how many
    parameters' gradients it carries and ``slots`` where each lies in the flat buffer (DP:
    the reducer's buckets are built from them), ``source`` a broadcast's root rank,
    ``layer`` the module whose activations a tensor-parallel collective carries.
    """

    purpose: CollectivePurpose
    bucket: int | None = None
    unit: str = ""
    params: int = 0
    primitive: str = ""
    algorithm: AlgorithmFact | None = None
    codec: CodecFact | None = None
    source: int | None = None
    slots: tuple[Slot, ...] = ()
    layer: str = ""


@dataclass(frozen=True)
class UnitFact:
    """A ZeRO-3 unit's layout: its ``index`` in the shard layout, the ``dtype`` of its
    shards, its parameters in buffer order (each ``Slot``'s offset is where it starts in
    the unsharded buffer) and the buffer's ``alignment_bytes``; what the engine builds
    the unit from."""

    index: int
    dtype: str
    params: tuple[Slot, ...]
    alignment_bytes: int


@dataclass(frozen=True)
class Gather:
    """A parameter gather of ``unit`` (its collective is the node's spec): held for
    ``span``, through ``primitive`` and ``algorithm``; ``frozen`` units have no gradient.
    A unit's first forward gather carries its ``layout``."""

    unit: str
    span: GatherSpan
    primitive: str = "all_gather"
    frozen: bool = False
    algorithm: AlgorithmFact | None = None
    layout: UnitFact | None = None


@dataclass(frozen=True)
class Free:
    """Freeing ``unit``'s gathered parameters."""

    unit: str


@dataclass(frozen=True)
class Transfer:
    """A point-to-point send or recv between pipeline stages: ``what`` of ``microbatch``
    (``dtype`` x ``numel``) to or from pipeline rank ``peer`` (the position along the
    ``pp`` axis holding the other stage; every pipeline of the mesh sends alike), for
    ``stage``."""

    peer: int
    stage: int
    microbatch: int
    what: TransferPayload
    dtype: str
    numel: int
    element_size: int
    #: The mesh axis the pipeline runs along (its links carry the transfer).
    axis: str = "pp"

    @property
    def nbytes(self) -> int:
        """Bytes sent or received."""
        return self.numel * self.element_size


NodeDetail = Compute | Collective | Gather | Free | Transfer

#: The detail type of each node kind.
DETAIL_OF_KIND: dict[str, type] = {
    "forward": Compute,
    "backward": Compute,
    "optimizer": Compute,
    "collective": Collective,
    "gather": Gather,
    "free": Free,
    "send": Transfer,
    "recv": Transfer,
}
