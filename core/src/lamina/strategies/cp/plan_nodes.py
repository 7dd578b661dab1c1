"""The execution plan of a context-parallel step: :func:`build_context_plan`.

Per attention site (the ``n``-th attention call of a forward, :mod:`.probe`), the nodes
of the algorithm chosen for it (:mod:`.attention`): ``all_gather`` gathers keys and
values (one all-gather forward, one reduce-scatter of their gradients backward);
``pass_kv`` passes them around the ring (``cp - 1`` send/recv pairs forward; backward
``cp - 1`` pairs of keys and values again and ``cp`` pairs of their gradients, the last
bringing each rank its own); ``all_to_all`` exchanges heads for tokens (two all-to-alls
forward, two backward). Each output cut on the sequence is all-gathered once forward;
without a sharder the parameter gradients are all-reduced over the cp group (and any
replica axes) after backward. A ring transfer's ``peer`` is the offset along the ring
(+1 the next rank, -1 the previous), so the plan reads the same on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lamina.dtypes import dtype_from_name, dtype_name
from lamina.runtime import Collective, CollectiveSpec, Compute, ExecutionPlan, PlanNode
from lamina.runtime.broadcasts import broadcast_nodes
from lamina.runtime.nodes import AlgorithmFact, CollectivePurpose, Transfer
from lamina.runtime.plan import meta_items
from lamina.runtime.render import (
    BLOCK_BACKWARD,
    BLOCK_FORWARD,
    CONTEXT_AXIS,
    EXTRA_BLOCKS,
    LOCAL_STEP,
    RING_BLOCKS,
)
from lamina.strategies.coalesced import dtype_totals
from lamina.strategies.cp.layout import extra_blocks

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


@dataclass(frozen=True)
class AttentionSite:
    """One attention call of the forward, as the probe saw it at this rank's length."""

    index: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: str
    causal: bool
    #: The innermost module running the call (``blocks.0.attn``), and which of its calls
    #: it is in one run of that module: how the call is found again at run time, also in
    #: a pipeline stage that runs some of the model's blocks only.
    module: str = ""
    call: int = 0

    def describe(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"attention {self.index}: {self.heads} heads, {self.kv_heads} key/value heads, "
            f"head dim {self.head_dim}, {mask}"
        )


@dataclass(frozen=True)
class SiteNodes:
    """Node ids of attention site ``site``."""

    site: int

    def _id(self, what: str) -> str:
        return f"attention.{self.site}.{what}"

    @property
    def gather(self) -> str:
        return self._id("gather_kv")

    @property
    def regather(self) -> str:
        return self._id("regather_kv")

    @property
    def scatter(self) -> str:
        return self._id("scatter_kv_grad")

    def send(self, step: int) -> str:
        return self._id(f"send_kv.{step}")

    def recv(self, step: int) -> str:
        return self._id(f"recv_kv.{step}")

    def send_back(self, step: int) -> str:
        return self._id(f"send_kv_backward.{step}")

    def recv_back(self, step: int) -> str:
        return self._id(f"recv_kv_backward.{step}")

    def send_grad(self, step: int) -> str:
        return self._id(f"send_kv_grad.{step}")

    def recv_grad(self, step: int) -> str:
        return self._id(f"recv_kv_grad.{step}")

    @property
    def heads_in(self) -> str:
        return self._id("heads_in")

    @property
    def heads_in_back(self) -> str:
        return self._id("heads_in_grad")

    @property
    def heads_out(self) -> str:
        return self._id("heads_out")

    @property
    def heads_out_back(self) -> str:
        return self._id("heads_out_grad")


def site_nodes(site: int) -> SiteNodes:
    """The node ids of attention site ``site``."""
    return SiteNodes(site)


def output_node(index: int) -> str:
    """The all-gather of the ``index``-th output cut on the sequence."""
    return f"output.{index}"


def gradients_node(dtype: str) -> str:
    """The all-reduce of the ``dtype`` parameter gradients (cp without a sharder)."""
    return f"gradients.{dtype}"


@dataclass(frozen=True)
class OutputSite:
    """An output cut on the sequence: its whole shape and dtype."""

    shape: tuple[int, ...]
    dtype: str


def build_context_plan(
    sites: tuple[AttentionSite, ...],
    algorithms: tuple[str, ...],
    outputs: tuple[OutputSite, ...],
    local_length: int,
    model: nn.Module,
    group: tuple[int, ...],
    axis: str,
    world: int,
    backend: str,
    sync: tuple[tuple[int, ...], str] | None,
    meta: tuple[tuple[str, str], ...] = (),
    broadcast: bool = True,
    sync_algorithms: dict[str, AlgorithmFact] | None = None,
) -> ExecutionPlan:
    """The step's plan: ``sites`` run ``algorithms`` over this rank's cp ``group`` on
    ``axis``; ``sync`` the group and axis label the gradients are all-reduced over
    (None: a sharder composed after cp syncs them); ``broadcast``: whether the setup
    broadcasts the whole model from rank 0 (not after a strategy that cut it)."""
    state = dtype_totals([t for t in (*model.parameters(), *model.buffers()) if not t.is_meta])
    whole = broadcast and world > 1
    nodes = broadcast_nodes("setup", state, tuple(range(world)), "world") if whole else []
    nodes += [
        PlanNode(FORWARD, "forward", "forward", "forward (context parallel)", Compute()),
        PlanNode(BACKWARD, "backward", "backward", "backward (autograd)", Compute()),
    ]
    n = len(group)

    def collective(
        node_id: str,
        phase: str,
        op: str,
        numel: int,
        dtype: str,
        what: str,
        ranks: tuple[int, ...] = group,
        on: str = axis,
        algorithm: AlgorithmFact | None = None,
    ) -> None:
        spec = CollectiveSpec(op, dtype, numel, dtype_from_name(dtype).itemsize, ranks, axis=on)
        purpose: CollectivePurpose = (
            "gradient" if node_id.startswith("gradients.") else "activation"
        )
        nodes.append(
            PlanNode(
                node_id,
                "collective",
                phase,
                what,
                Collective(purpose, layer=what, algorithm=algorithm),
                spec,
            )
        )

    def transfer(
        node_id: str, kind: str, phase: str, site: AttentionSite, step: int, numel: int, grad: bool
    ) -> None:
        detail = Transfer(
            peer=1 if kind == "send" else -1,
            stage=site.index,
            microbatch=step,
            what="gradient" if grad else "activation",
            dtype=site.dtype,
            numel=numel,
            element_size=dtype_from_name(site.dtype).itemsize,
            axis=axis,
        )
        nodes.append(
            PlanNode(node_id, kind, phase, f"attention {site.index}: ring step {step}", detail)
        )

    for site, algorithm in zip(sites, algorithms, strict=True):
        ids = site_nodes(site.index)
        kv = 2 * site.batch * site.kv_heads * local_length * site.head_dim
        if algorithm == "all_gather":
            what = f"attention {site.index}: keys and values"
            collective(ids.gather, "forward", "all_gather", n * kv, site.dtype, what)
            collective(ids.regather, "backward", "all_gather", n * kv, site.dtype, what + " again")
            collective(
                ids.scatter, "backward", "reduce_scatter", n * kv, site.dtype, what + " gradients"
            )
        elif algorithm == "pass_kv":
            for step in range(1, n):
                transfer(ids.send(step), "send", "forward", site, step, kv, False)
                transfer(ids.recv(step), "recv", "forward", site, step, kv, False)
                transfer(ids.send_back(step), "send", "backward", site, step, kv, False)
                transfer(ids.recv_back(step), "recv", "backward", site, step, kv, False)
            for step in range(1, n + 1):
                transfer(ids.send_grad(step), "send", "backward", site, step, kv, True)
                transfer(ids.recv_grad(step), "recv", "backward", site, step, kv, True)
        else:
            width = (site.heads + 2 * site.kv_heads) * site.batch * local_length * site.head_dim
            out = site.heads * site.batch * local_length * site.head_dim
            what = f"attention {site.index}: "
            collective(ids.heads_in, "forward", "all_to_all", width, site.dtype, what + "heads in")
            collective(ids.heads_out, "forward", "all_to_all", out, site.dtype, what + "heads out")
            collective(
                ids.heads_out_back,
                "backward",
                "all_to_all",
                out,
                site.dtype,
                what + "heads out gradient",
            )
            collective(
                ids.heads_in_back,
                "backward",
                "all_to_all",
                width,
                site.dtype,
                what + "heads in gradient",
            )
    for k, output in enumerate(outputs):
        collective(
            output_node(k),
            "forward",
            "all_gather",
            math.prod(output.shape),
            output.dtype,
            f"output {k}: sequence gathered",
        )
    if sync is not None:
        ranks, label = sync
        totals: dict[str, int] = {}
        for p in model.parameters():
            if p.requires_grad:
                totals[dtype_name(p.dtype)] = totals.get(dtype_name(p.dtype), 0) + p.numel()
        for dtype, numel in sorted(totals.items()):
            collective(
                gradients_node(dtype),
                "backward",
                "all_reduce",
                numel,
                dtype,
                f"{dtype} gradients averaged",
                ranks,
                label,
                (sync_algorithms or {}).get(dtype),
            )
    nodes.append(
        PlanNode(OPTIMIZER, "optimizer", "step", "optimizer step (user's optimizer)", Compute())
    )
    edges = [(FORWARD, BACKWARD)]
    for node in nodes:
        if node.phase == "setup":
            edges.append((node.id, FORWARD))
        elif node.kind in ("collective", "send", "recv"):
            if node.phase == "forward":
                edges += [(FORWARD, node.id), (node.id, BACKWARD)]
            else:
                edges += [(BACKWARD, node.id), (node.id, OPTIMIZER)]
    edges.append((BACKWARD, OPTIMIZER))
    return ExecutionPlan(
        strategy="cp",
        world_size=world,
        backend=backend,
        nodes=tuple(nodes),
        edges=tuple(edges),
        meta=(*meta_items(cp=n), (CONTEXT_AXIS, axis), *meta),
    )


def compute_meta(
    timed: Any, layout: Any, sites: tuple[AttentionSite, ...]
) -> tuple[tuple[str, str], ...]:
    """The measured compute the simulator prices a cp step from: a whole block's forward
    and backward, this rank's local step, and per step the blocks cp adds over all calls
    and a ring step's blocks (per call)."""
    added = sum(extra_blocks(layout, s.causal) for s in sites)
    causal = any(s.causal for s in sites)
    ring = len(layout.local_chunks) ** 2 * (0.5 if causal else 1.0)
    return (
        (BLOCK_FORWARD, f"{timed.block_forward_s:.6g}"),
        (BLOCK_BACKWARD, f"{timed.block_backward_s:.6g}"),
        (LOCAL_STEP, f"{timed.local_step_s:.6g}"),
        (EXTRA_BLOCKS, f"{added:g}"),
        (RING_BLOCKS, f"{ring:g}"),
    )


def dtype_of(t: torch.Tensor) -> str:
    """The plan's name of ``t``'s dtype."""
    return dtype_name(t.dtype)
