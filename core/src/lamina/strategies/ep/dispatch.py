"""Dropless token dispatch over the ep group: the :class:`Dispatcher` contract and the
built-in :class:`AllToAllDispatcher`.

A dispatcher is a plugin point (``lamina_register_dispatchers``, :mod:`.registry`): a
backend can ship a faster one (fused permutes, a device-initiated exchange) without
touching core; :func:`lamina.testing.dispatchers.check_dispatcher` checks one against
the whole layer in one process.

An MoE layer's ``E`` experts lie on the ``n`` ranks of the ep group, ``E / n``
consecutive experts a rank. Each rank routes its own tokens (each token's top ``k``
experts and their weights); the dispatcher moves every (token, expert) assignment to the
rank holding the expert, has that rank's experts compute them, and brings the results
back, each multiplied by its router weight and summed into its token:

1. the assignments per expert, counted on each rank, are exchanged in one all-to-all
   (``E / n`` counts to each peer, after the layer's index: a peer at another layer is
   named in one line), so every rank knows what it will receive;
2. the tokens go in one all-to-all of uneven splits, sorted by expert (so by
   destination rank, then expert);
3. what arrived (by source rank, then expert) is regrouped by local expert and each
   expert computes its tokens in one call;
4. the results go back in the reverse all-to-all and are combined into their tokens.

No capacity factor: no token is dropped. Both token exchanges are autograd functions
whose backward is the reverse exchange of the gradients. Every exchange goes through
``torch.distributed.all_to_all_single`` and is announced to ``issuing`` (the step's run
log, under the plan node :class:`DispatchNodes` names).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lamina.errors import ConfigError

#: Announces a collective before it is issued: (plan node id, op, bytes, in backward).
Issuing = Callable[[str, str, int, bool], AbstractContextManager[None]]
#: Computes a rank's experts: the tokens grouped by local expert, and how many each has.
ExpertsFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


@contextmanager
def untracked(_node: str, _op: str, _nbytes: int, _backward: bool) -> Iterator[None]:
    """No run log: nothing recorded."""
    yield


@dataclass(frozen=True)
class ExpertGroup:
    """This rank's ep group: the process group (None: the default one), its size, this
    rank's index in it, and the experts of the layer over all of it."""

    group: dist.ProcessGroup | None
    size: int
    index: int
    experts: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.experts % self.size:
            raise ConfigError(
                f"expert parallelism: {self.experts} experts do not split over ep={self.size} "
                f"ranks; choose an ep degree that divides {self.experts}"
            )

    @property
    def local(self) -> int:
        """Experts each rank holds."""
        return self.experts // self.size

    @property
    def first(self) -> int:
        """The global index of this rank's first expert."""
        return self.index * self.local


@dataclass(frozen=True)
class DispatchNodes:
    """Plan node ids of one MoE layer's exchanges."""

    layer: int

    def _id(self, what: str) -> str:
        return f"moe.{self.layer}.{what}"

    @property
    def counts(self) -> str:
        return self._id("counts")

    @property
    def tokens(self) -> str:
        return self._id("tokens")

    @property
    def results(self) -> str:
        return self._id("results")

    @property
    def tokens_grad(self) -> str:
        return self._id("tokens_grad")

    @property
    def results_grad(self) -> str:
        return self._id("results_grad")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Exchange(torch.autograd.Function):
    """Rows of ``x`` sent in ``send`` splits, ``receive`` splits arriving; backward: the
    gradient's rows sent back the other way."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send: list[int],
        receive: list[int],
        ep: ExpertGroup,
        issuing: Issuing,
        nodes: tuple[str, str],
    ) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.ep, ctx.issuing, ctx.back = send, receive, ep, issuing, nodes[1]
        return _all_to_all(x, send, receive, ep, issuing, nodes[0], backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = _all_to_all(grad, ctx.receive, ctx.send, ctx.ep, ctx.issuing, ctx.back, True)
        return back, None, None, None, None, None


def _all_to_all(
    x: torch.Tensor,
    send: list[int],
    receive: list[int],
    ep: ExpertGroup,
    issuing: Issuing,
    node: str,
    backward: bool,
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    with issuing(node, "all_to_all", _nbytes(x), backward):
        dist.all_to_all_single(out, x, receive, send, group=ep.group)
    return out


def _exchange_counts(
    counts: torch.Tensor, ep: ExpertGroup, layer: int, issuing: Issuing, node: str
) -> torch.Tensor:
    """Each peer's assignments to this rank's experts, ``(peers, local experts)``: every
    rank sends each peer its counts for that peer's experts, after the MoE layer it is
    at, so a peer at another layer (the ranks ran different layers: their exchanges would
    pair up wrong) is named in one line instead of exchanging tokens of the wrong size."""
    layers = torch.full((ep.size, 1), layer, dtype=counts.dtype, device=counts.device)
    sent = torch.cat([layers, counts.reshape(ep.size, ep.local)], dim=1).reshape(-1)
    received = torch.empty_like(sent)
    with issuing(node, "all_to_all", _nbytes(sent), False):
        dist.all_to_all_single(received, sent, group=ep.group)
    received = received.reshape(ep.size, ep.local + 1)
    at = received[:, 0].tolist()
    other = next((peer for peer, theirs in enumerate(at) if theirs != layer), None)
    if other is not None:
        raise ConfigError(
            f"expert parallelism: rank {other} of the ep group is at MoE layer {at[other]} "
            f"while rank {ep.index} is at MoE layer {layer}; every rank of the ep group must "
            "run the same MoE layers in the same order (the same model, inputs of the same "
            "shape, no layer skipped on some ranks)"
        )
    return received[:, 1:]


def _by_expert(received: torch.Tensor) -> torch.Tensor:
    """Indices putting rows that arrived by source rank, then local expert (``received``:
    ``(sources, experts)`` counts) in order of local expert, then source rank."""
    counts = received.reshape(-1)
    starts = torch.cumsum(counts, 0) - counts  # where each (source, expert) segment starts
    by_expert = starts.reshape(received.shape).t().reshape(-1)
    sizes = received.t().reshape(-1)
    if int(sizes.sum()) == 0:
        return torch.zeros(0, dtype=torch.int64, device=received.device)
    offsets = torch.cumsum(sizes, 0) - sizes
    base = torch.repeat_interleave(by_expert - offsets, sizes)
    return base + torch.arange(int(sizes.sum()), device=received.device)


class Dispatcher(ABC):
    """How an MoE layer's tokens reach the experts that hold them and come back: the
    contract a plugin implements (one instance serves every layer and group)."""

    #: The name ``dispatcher=`` takes.
    name: ClassVar[str]

    @abstractmethod
    def dispatch(
        self,
        ep: ExpertGroup,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        experts: ExpertsFn,
        layer: int = 0,
        issuing: Issuing = untracked,
    ) -> torch.Tensor:
        """Each token of ``hidden`` (``(tokens, dim)``) through its ``top_k_index``
        experts (``(tokens, k)``, global ids over ``ep``), weighted by ``top_k_weights``
        and summed, with this rank's experts computed by ``experts`` (the tokens grouped
        by local expert, and each one's count). Collective over ``ep``; every exchange
        announced to ``issuing`` under :class:`DispatchNodes` ``(layer)``'s ids; autograd
        flows to ``hidden``, ``top_k_weights`` and the experts."""


class AllToAllDispatcher(Dispatcher):
    """Dropless dispatch in two all-to-alls of uneven splits (see the module)."""

    name = "all_to_all"

    def dispatch(
        self,
        ep: ExpertGroup,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        experts: ExpertsFn,
        layer: int = 0,
        issuing: Issuing = untracked,
    ) -> torch.Tensor:
        """See :meth:`Dispatcher.dispatch`."""
        nodes = DispatchNodes(layer)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= ep.experts):
            raise ConfigError(
                f"expert parallelism: the router chose expert {int(flat.max())} or "
                f"{int(flat.min())}, outside the layer's {ep.experts} experts"
            )
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        counts = torch.bincount(flat, minlength=ep.experts)
        received = _exchange_counts(counts, ep, layer, issuing, nodes.counts)
        send = counts.reshape(ep.size, ep.local).sum(1).tolist()
        receive = received.sum(1).tolist()
        sent = hidden[token_of]
        arrived = _Exchange.apply(  # type: ignore[no-untyped-call]
            sent, send, receive, ep, issuing, (nodes.tokens, nodes.tokens_grad)
        )
        regroup = _by_expert(received)
        computed = experts(arrived[regroup], received.sum(0).tolist())
        back = computed[torch.argsort(regroup)]
        results = _Exchange.apply(  # type: ignore[no-untyped-call]
            back, receive, send, ep, issuing, (nodes.results, nodes.results_grad)
        )
        weights = top_k_weights.reshape(-1)[order].to(results.dtype)
        combined = torch.zeros_like(hidden, dtype=results.dtype)
        combined = combined.index_add(0, token_of, results * weights[:, None])
        return combined.to(hidden.dtype)


__all__ = [
    "AllToAllDispatcher",
    "DispatchNodes",
    "Dispatcher",
    "ExpertGroup",
    "ExpertsFn",
    "Issuing",
    "untracked",
]
