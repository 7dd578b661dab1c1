"""The methods a context-parallel model gains (its class is extended, not wrapped).

Its forward takes the whole sequence, as in one process. It keeps this rank's tokens of
every input cut on the sequence (:mod:`.layout`), gives the model's position calls the
global positions of those tokens (:mod:`.probe`), runs each attention call as
context-parallel attention (:mod:`.attention`) and gathers every output cut on the
sequence back into the whole sequence, so the loss a loop computes is the one-process
loss. ``document_ids=`` (``(batch, tokens)``), or position ids that restart per
document, mask packed documents exactly across ranks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lamina.comm.algorithms import AlgorithmGroups
from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.runtime import ExecutionPlan, RunLog
from lamina.strategies.cp.attention import Call, attend
from lamina.strategies.cp.calls import SDPA, attention_call, ranged
from lamina.strategies.cp.comm import ContextGroup, GatherSequence
from lamina.strategies.cp.masks import Masking, documents_from_positions
from lamina.strategies.cp.plan_nodes import AttentionSite, gradients_node, output_node
from lamina.strategies.cp.probe import cut_inputs
from lamina.strategies.surface import PIPELINE_KEY, DistributedModule
from lamina.verify import PreflightReport


@dataclass
class GradientSync:
    """cp without a sharder: after backward, each dtype's parameter gradients averaged
    over the cp group and any replica axes in one all-reduce (their cp scale makes the
    average over cp a sum), with the algorithm the cost model chose for its size and the
    group's hosts (hierarchical across hosts, as dp's buckets)."""

    parameters: list[torch.nn.Parameter]
    group: dist.ProcessGroup | None
    cp: ContextGroup
    #: Per dtype name, the all-reduce algorithm and chunks the plan chose (absent: flat).
    algorithms: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: The process groups of the chosen algorithms (None: flat only).
    groups: AlgorithmGroups | None = None
    queued: bool = False

    def queue(self) -> None:
        """Run :meth:`run` when autograd finishes this backward (once)."""
        if self.queued:
            return
        self.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.run)

    def run(self) -> None:
        self.queued = False
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.parameters:
            if p.grad is not None:
                by_dtype.setdefault(p.dtype, []).append(p.grad)
        for dtype, grads in sorted(by_dtype.items(), key=lambda item: str(item[0])):
            flat = torch.cat([g.reshape(-1) for g in grads])
            name = dtype_name(dtype)
            node = gradients_node(name)
            algorithm, chunks = self.algorithms.get(name, ("flat", 1))
            with self.cp.log.issuing(node, "all_reduce", flat.numel() * flat.element_size(), True):
                if self.groups is not None and algorithm != "flat":
                    self.groups.all_reduce(algorithm, flat, chunks).wait()
                else:
                    dist.all_reduce(flat, group=self.group)
            flat /= dist.get_world_size(self.group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


@dataclass
class ContextParallelism:
    """What a context-parallel model carries."""

    group: ContextGroup
    sites: tuple[AttentionSite, ...]
    algorithms: tuple[str, ...]
    positional: frozenset[tuple[str, int]]
    execution_plan: ExecutionPlan
    run_log: RunLog
    preflight: PreflightReport | None
    dim: int
    #: Keyword arguments the forward adds (transformers models: position ids).
    extra: Callable[[torch.Tensor], dict[str, Any]] = field(default=lambda positions: {})
    sync: GradientSync | None = None
    #: The module running an attention call now and its calls so far (set by the
    #: forward pre-hooks :meth:`watch` puts on the sites' modules).
    running: list[Any] = field(default_factory=lambda: ["", 0])

    def watch(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks on each attention site's module that name it running, so a
        call is found by its module (a pipeline stage runs some of the sites only)."""
        for name in {s.module for s in self.sites if s.module}:

            def running(_m: torch.nn.Module, _args: Any, name: str = name) -> None:
                self.running[0], self.running[1] = name, 0

            model.get_submodule(name).register_forward_pre_hook(running)

    def locate(self, counted: int) -> int:
        """The site of the attention call running now: by its module and the call in
        it, else the ``counted``-th call of the forward."""
        module, call = self.running
        self.running[1] = call + 1
        for site in self.sites:
            if module and site.module == module and site.call == call:
                return site.index
        return counted


#: Where a pipeline composed after cp keeps its state on the model.
PIPELINED = PIPELINE_KEY


class _ContextCalls(TorchFunctionMode):
    """Replaces the forward's position calls and attention calls (see the module)."""

    def __init__(self, state: ContextParallelism, documents: torch.Tensor | None) -> None:
        super().__init__()
        self.state = state
        self.documents = documents
        self.local = state.group.layout.local_length
        self.counts: dict[str, int] = {}
        self.site = 0

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is SDPA:
            return self._attention(args, kwargs)
        found = ranged(func, args, kwargs)
        if found is not None and found.length == self.local:
            k = self.counts.get(found.kind, 0)
            self.counts[found.kind] = k + 1
            if (found.kind, k) in self.state.positional:
                return self._positions(func, args, kwargs, found.dim, found.start)
        return func(*args, **kwargs)

    def _positions(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dim: int, start: int
    ) -> Any:
        layout = self.state.group.layout
        if func is torch.arange:
            dtype = kwargs.get("dtype") or torch.int64
            device = kwargs.get("device")
            return (layout.positions(device) + start).to(dtype)
        tensor: torch.Tensor = args[0]
        return tensor.index_select(dim, layout.positions(tensor.device) + start)

    def _attention(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        call = attention_call(args, kwargs)
        state = self.state
        index = state.locate(self.site)
        self.site += 1
        if (
            index >= len(state.sites)
            or call.attn_mask is not None
            or call.query.shape[-2] != self.local
        ):
            raise ConfigError(
                f"context-parallel attention call {index} differs from the planned one "
                f"(query {tuple(call.query.shape)}, mask "
                f"{'given' if call.attn_mask is not None else 'none'}, {len(state.sites)} "
                "planned calls); distribute the model again for this input"
            )
        masking = Masking(call.is_causal, self.documents)
        return attend(
            state.algorithms[index],
            call.query,
            call.key,
            call.value,
            state.group,
            Call(index, masking, call.scale),
        )


class ContextParallelModule(DistributedModule):
    """A model whose sequence is split across the cp ranks (see the module)."""

    lamina_cp: ContextParallelism

    @property
    def execution_plan(self) -> ExecutionPlan:
        """The step's plan (attention collectives and transfers, output gathers)."""
        return self.lamina_cp.execution_plan

    @property
    def run_log(self) -> RunLog:
        """What the step issued."""
        return self.lamina_cp.run_log

    def step_summary(self) -> str:
        """Each attention call and its algorithm, one per line."""
        state = self.lamina_cp
        layout = state.group.layout
        head = (
            f"cp={layout.size}: {layout.length} tokens, {layout.local_length} per rank"
            f"{' (head and tail chunks)' if layout.balanced else ''}"
        )
        lines = [f"{s.describe()}: {a}" for s, a in zip(state.sites, state.algorithms, strict=True)]
        return "\n".join([head, *lines])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on the whole sequence (see the module)."""
        state = self.lamina_cp
        cp = state.group
        layout = cp.layout
        dim = state.dim
        documents = kwargs.pop("document_ids", None)
        first = next(
            (t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None
        )
        if first is None or first.dim() <= dim or first.shape[dim] != layout.length:
            got = None if first is None or first.dim() <= dim else first.shape[dim]
            raise ConfigError(
                f"this context-parallel model was planned for sequences of {layout.length} "
                f"tokens (dim {dim} of the first input), got {got}; pad or cut batches to "
                f"{layout.length} tokens, or distribute again with example_inputs of the new length"
            )
        position_ids = kwargs.get("position_ids")
        if documents is None and isinstance(position_ids, torch.Tensor):
            documents = documents_from_positions(position_ids)
        if documents is not None:
            documents = self._documents(documents, first)
        attention_mask = kwargs.get("attention_mask")
        if isinstance(attention_mask, torch.Tensor) and not bool(attention_mask.bool().all()):
            raise ConfigError(
                "context parallelism does not take a padding attention_mask; pack documents "
                "without padding and pass document_ids= (or position ids restarting per document)"
            )
        args = cut_inputs(args, layout.length, dim, lambda t: layout.shard(t, dim))
        kwargs = cut_inputs(kwargs, layout.length, dim, lambda t: layout.shard(t, dim))
        for key, value in state.extra(layout.positions(first.device)).items():
            kwargs.setdefault(key, value)
        if torch.is_grad_enabled() and PIPELINED not in self.__dict__:
            # a step per forward; under a pipeline, a forward per stage and microbatch:
            # the log then keeps counting over the steps
            cp.log.begin_step()
        with _ContextCalls(state, documents):
            out = super().forward(*args, **kwargs)
        count = iter(range(1 << 30))

        def gather(t: Any) -> Any:
            if (
                isinstance(t, torch.Tensor)
                and t.dim() > dim
                and t.shape[dim] == layout.local_length
            ):
                node = output_node(next(count))
                return GatherSequence.apply(t, dim, cp, node, state.sync)  # type: ignore[no-untyped-call]
            return t

        return pytree.tree_map(gather, out)

    def _documents(self, documents: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        layout = self.lamina_cp.group.layout
        if documents.dim() == 1:
            documents = documents.unsqueeze(0)
        if documents.shape[-1] != layout.length:
            raise ConfigError(
                f"document_ids holds {documents.shape[-1]} tokens per row, the batch "
                f"{layout.length}; give one document id per token, shape (batch, tokens)"
            )
        return documents.to(first.device).expand(first.shape[0], -1)


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes keyword ``name``."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
