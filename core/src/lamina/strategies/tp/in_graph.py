"""Tensor parallelism inside a sharding strategy's compiled step:
:class:`TensorParallelInGraph` (the
:class:`~lamina.strategies.compiled.in_graph.InGraphCollectives` of ``tp``).

The layers' collectives are captured with the forward and its backward
(:mod:`.graph_ops`). The calls they issue are the ones the last eager step issued, in
its order (:attr:`.activation_ops.StepLog.order`, kept from before the first capture),
each in the form the graph gives its plan op on this backend: on gloo a gather is one
broadcast per rank and a reduce-scatter an all-reduce, as in the eager step. Their sizes
follow the batch, so the check of the graph compares the op of each, not its elements.
The gradients of whole parameters the eager step sums over the group in its backward
(modules on sequence slices, or met by split activations; row-parallel biases added on
sequence slices) are summed by the compiled step after the backward, with the same
all-reduce per plan node.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lamina.strategies.compiled.graph_collectives import PlannedCall
from lamina.strategies.tp.graph_ops import group_of, native
from lamina.strategies.tp.module import TensorParallelism
from lamina.strategies.tp.plan_nodes import bias_node, params_node

#: The mesh axis named when the plan names none.
_DEFAULT_AXIS = "tp"


class TensorParallelInGraph:
    """What a compiled step needs of a tensor-parallel model (see the module)."""

    name = "tp"

    def __init__(self, state: TensorParallelism, model: nn.Module) -> None:
        if state.step_log is None:
            raise ValueError("a tensor-parallel model built without its step log")
        self.state = state
        self.log = state.step_log
        self.pg = group_of(state.group.group)
        self._summed = _summed_parameters(state, model)
        #: The plan nodes one training step issues, in order (:meth:`keep_order`).
        self.order: list[str] = []

    def keep_order(self) -> None:
        """Keep what the last eager step issued, in its order (an evaluation's forward
        issues more into the log later; the captured graph must not read the log)."""
        self.order = list(self.log.order)

    def planned_calls(self) -> list[PlannedCall]:
        """The calls of the last eager step's collectives in the captured forward and
        backward, in its order."""
        plan = self.log.run_log.plan
        fast = native(self.pg)
        size = dist.get_world_size(self.pg)
        calls: list[PlannedCall] = []
        for node in self.order:
            if node in self._summed:
                continue
            spec = plan.node(node).collective
            assert spec is not None
            if spec.op == "all_gather" and not fast:
                calls += [PlannedCall(node, "broadcast", None)] * size
            elif spec.op == "reduce_scatter" and not fast:
                calls.append(PlannedCall(node, "all_reduce", None))
            else:
                calls.append(PlannedCall(node, spec.op, None))
        return calls

    def summed_gradients(self) -> list[tuple[str, tuple[str, ...]]]:
        """The whole parameters' gradient sums of the last eager step, in its order."""
        return [(n, self._summed[n]) for n in dict.fromkeys(self.order) if n in self._summed]

    def record_replay(self) -> None:
        """A step in the tp run log with the eager step's nodes issued."""
        run_log = self.log.run_log
        run_log.begin_step()
        for node in self.order:
            run_log.issued(node)
        run_log.end_backward()

    def split_parameters(self) -> frozenset[str]:
        """The parameters the plan cut."""
        return frozenset(self.state.views.splits)

    def group(self) -> tuple[dist.ProcessGroup, tuple[int, ...], str]:
        """The tp group, its ranks and its axis."""
        plan = self.log.run_log.plan
        axis = next((n.collective.axis for n in plan.collectives() if n.collective), None)
        ranks = tuple(dist.get_process_group_ranks(self.pg))
        return self.pg, ranks, axis or _DEFAULT_AXIS


def _summed_parameters(state: TensorParallelism, model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The plan nodes summing whole parameters' gradients, and those parameters' names
    (each module's own trained ones, in its order, as the eager step concatenates them)."""
    plan = state.plan
    modules = [*plan.sequence_modules] if plan.sequence_parallel else []
    modules += [name for name, _ in plan.shared_modules]
    summed: dict[str, tuple[str, ...]] = {}
    for name in modules:
        module = model.get_submodule(name)
        own = tuple(
            f"{name}.{p}" if name else p
            for p, t in module._parameters.items()
            if t is not None and t.requires_grad
        )
        if own:
            summed[params_node(name)] = own
    if plan.sequence_parallel:
        for region in plan.regions:
            for row in region.rows:
                linear = model.get_submodule(row.linear)
                if row.reduce == "scatter" and getattr(linear, "bias", None) is not None:
                    summed[bias_node(row.linear)] = (f"{row.linear}.bias",)
    return summed
