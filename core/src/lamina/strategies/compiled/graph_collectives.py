"""The collectives of a captured step, read from its graph and checked before it runs.

``torch.compile`` hands the captured FX graph to a backend before the graph first runs.
:class:`CheckedBackend` is that backend: it reads the graph's functional collectives
(:func:`graph_collectives`: op, elements, dtype, group, in graph order), checks them
against the collectives the plan says the step issues (:class:`PlannedCall`, in plan
order), compares them across the ranks with the pre-flight check (a mismatch is a
``VerificationError`` naming the rank and the first differing collective, as for the
plan), and only then compiles the graph with the backend the user chose (Inductor with
eager's random numbers, so dropout draws the eager step's masks). The ranks
agree on the outcome of that compilation: where it failed on one rank, it fails on every
rank (each then runs the eager step), so no rank runs a graph the others do not.

A capture that stops before the backend (a graph break) is agreed on the same way:
:meth:`CheckedBackend.capture_failed` enters the same comparison with that outcome, so a
rank that could not capture is named to the ranks that could, instead of leaving them
waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from lamina.dtypes import dtype_name
from lamina.errors import VerificationError
from lamina.strategies.compiled.compile_cache import CompileOnce
from lamina.verify import Manifest, preflight

#: The functional collectives' op names, and the family each belongs to.
_FAMILIES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}
#: The higher-order operation an autograd function is captured as (its forward and
#: backward bodies are subgraphs: tensor parallelism's collectives live there).
_AUTOGRAD_FUNCTION = torch.ops.higher_order.autograd_function_apply
#: The pre-flight category of the compiled graph's collectives.
CATEGORY = "compiled_graph"


@dataclass(frozen=True)
class PlannedCall:
    """One collective call the plan says the step issues: the plan node, the family
    (``all_reduce``, ``all_gather``, ...) and the elements of its whole buffer (a
    gather's output, a reduce-scatter's input; None: they follow the batch, as an
    activation's do, and only the op is checked)."""

    node: str
    op: str
    numel: int | None


@dataclass(frozen=True)
class GraphCollective:
    """One functional collective of a captured graph."""

    op: str
    numel: int
    dtype: str
    group: tuple[int, ...]

    def line(self) -> str:
        """Canonical text, the same on every rank of the job (groups by their size: the
        ranks of a shard or replica group differ from rank to rank by design)."""
        return f"{self.op} {self.numel} x {self.dtype} over {len(self.group)} ranks"


def _value(node: Any) -> Any:
    meta = getattr(node, "meta", {})
    return meta.get("example_value", meta.get("val"))


def graph_collectives(gm: torch.fx.GraphModule) -> list[GraphCollective]:
    """The functional collectives of ``gm`` in the order they run: graph order, with an
    autograd function's forward body in place and its backward body's collectives where
    the backward runs (at the graph's gradient call, the last function's first)."""
    found: list[GraphCollective] = []
    pending: list[list[GraphCollective]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _AUTOGRAD_FUNCTION:
            found += graph_collectives(getattr(gm, node.args[0].target))
            pending.append(graph_collectives(getattr(gm, node.args[1].target)))
            continue
        if getattr(node.target, "__name__", "") == "_autograd_grad":
            for body in reversed(pending):
                found += body
            pending.clear()
            continue
        collective = _collective(node)
        if collective is not None:
            found.append(collective)
    return found


def _collective(node: torch.fx.Node) -> GraphCollective | None:
    """``node`` as a functional collective (None: another operation)."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    family = _FAMILIES.get(name)
    if family is None or "_c10d_functional" not in str(node.target):
        return None
    tensor = _value(node.args[0])
    numel = int(tensor.numel())
    group = distributed_c10d._resolve_process_group(str(node.args[-1]))  # type: ignore[attr-defined,arg-type]
    ranks = tuple(dist.get_process_group_ranks(group))
    if family == "all_gather":
        numel *= len(ranks)
    return GraphCollective(family, numel, dtype_name(tensor.dtype), ranks)


def mismatch(planned: Sequence[PlannedCall], found: Sequence[GraphCollective]) -> str:
    """'' when the graph issues the plan's calls in order; else the first difference."""
    for i, (want, got) in enumerate(zip(planned, found, strict=False)):
        if want.op != got.op or want.numel not in (None, got.numel):
            return (
                f"collective {i} of the captured graph is {got.op} of {got.numel} elements, "
                f"the plan's node {want.node} issues {want.op} of "
                f"{'any size' if want.numel is None else want.numel}"
            )
    if len(planned) != len(found):
        return f"the captured graph issues {len(found)} collectives, the plan {len(planned)}"
    return ""


class CheckedBackend:
    """A ``torch.compile`` backend that checks each captured graph's collectives against
    ``planned()`` and across the ranks of ``group`` before compiling it with ``inner``.
    ``graphs`` keeps every graph's collectives, in capture order."""

    def __init__(
        self,
        inner: str | Callable[..., Any],
        planned: Callable[[], Sequence[PlannedCall]],
        group: dist.ProcessGroup | None,
        eager_random: bool = True,
        overlap: bool = False,
    ) -> None:
        self.inner = inner
        self.planned = planned
        self.group = group
        #: Inductor draws random numbers with eager's generator (``fallback_random``), so
        #: dropout's masks are the eager step's.
        self.eager_random = eager_random
        #: Inductor issues each collective as soon as its input is computed and waits for
        #: it as late as its result allows (its ``raise_comms`` and ``sink_waits``
        #: passes): DP's buckets then start where their last gradient is produced.
        self.overlap = overlap
        self.graphs: list[list[GraphCollective]] = []
        #: Graphs handed to this backend (a capture that stops earlier never gets here).
        self.entered = 0
        #: Inductor's graphs compiled by one rank each, loaded by the others (see
        #: :mod:`.compile_cache`); its ``outcomes`` say how each graph was compiled.
        self.once = CompileOnce(group)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Check ``gm`` (raising on a difference), then compile it with the inner backend;
        every rank learns whether every other one compiled."""
        self.entered += 1
        found = graph_collectives(gm)
        wrong = mismatch(self.planned(), found)
        if wrong:
            raise RuntimeError(f"the captured step does not follow its plan: {wrong}")
        self._compare(tuple(c.line() for c in found))
        self.graphs.append(found)
        inner = self.inner
        compile_with = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner
        patch: AbstractContextManager[Any] = nullcontext()
        settings: dict[str, Any] = {}
        if inner == "inductor":
            from torch._inductor import config as inductor_config

            settings = {"fallback_random": self.eager_random}
            if self.overlap:
                settings["reorder_for_compute_comm_overlap"] = True
                settings["reorder_for_compute_comm_overlap_passes"] = ["raise_comms", "sink_waits"]
            patch = inductor_config.patch(settings)
        try:
            with patch:
                if inner != "inductor":
                    compiled = compile_with(gm, example_inputs)
                else:  # one rank compiles, the others load its artifacts

                    def compile_here() -> Any:
                        return compile_with(gm, example_inputs)

                    compiled = self.once.compile(gm, example_inputs, inner, settings, compile_here)
        except Exception:
            self._agree(False)
            raise
        self._agree(True)
        return compiled

    def capture_failed(self, reason: str) -> None:
        """A capture stopped before this backend: compare that with the other ranks
        (a ``VerificationError`` where some captured a graph)."""
        self._compare((f"no graph: the capture stopped ({reason.split(':')[0]})",))

    def _compare(self, lines: tuple[str, ...]) -> None:
        if dist.is_available() and dist.is_initialized():
            preflight(Manifest(dist.get_rank(), ((CATEGORY, lines),)), group=self.group)

    def _agree(self, compiled: bool) -> None:
        """Raise on every rank unless every rank of the job compiled its graph."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        failed = torch.tensor([0 if compiled else 1], dtype=torch.int64)
        dist.all_reduce(failed, group=self.group)
        if compiled and int(failed) > 0:
            raise RuntimeError(
                f"{int(failed)} rank(s) could not compile the step; every rank runs it eagerly"
            )


def verification_error(exc: BaseException) -> VerificationError | None:
    """The pre-flight mismatch behind ``exc`` (torch.compile wraps a backend's errors)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, VerificationError):
            return seen
        inner = getattr(seen, "inner_exception", None)
        seen = inner if isinstance(inner, BaseException) else seen.__cause__
    return None
