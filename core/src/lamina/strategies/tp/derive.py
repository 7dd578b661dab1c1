"""The tensor-parallel plan derived from one recorded forward: :func:`derive_plan`.

Every activation is followed op by op (:mod:`.trace`) with the dimension it would be
split on. A linear fed a replicated activation starts a region (column-parallel: its
output features split); ops that keep the split dimension apart (elementwise, views that
split features into heads, transposes, attention, matmuls over heads) carry it on; a
linear fed the split features ends the region (row-parallel). A region reached by an op
that would mix the split dimension (a norm over it, a reduction) stays replicated, with
the op named. A region that reaches the model's output is a vocabulary-parallel head; an
embedding whose vocabulary ``tp`` divides is vocabulary-parallel. A view that splits a
column's output into a head count ``tp`` does not divide is a one-line ConfigError,
raised here, before any collective.

With sequence parallelism, the activations between regions are followed as sequence
slices from the first block that holds a region: only token-wise ops may touch them, and
the modules whose parameters they meet (norms) have their gradients summed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.strategies.tp.layers import Column, Region, Row, TensorPlan, VocabLayer
from lamina.strategies.tp.trace import ModuleCall, OpRecord, RecordedForward, record_forward

_SAME_SHAPE = frozenset(
    (
        "dropout",
        "gelu",
        "silu",
        "relu",
        "tanh",
        "sigmoid",
        "exp",
        "neg",
        "rsqrt",
        "sqrt",
        "abs",
        "float",
        "half",
        "bfloat16",
        "to",
        "type_as",
        "contiguous",
        "clone",
        "detach",
        "cos",
        "sin",
        "__neg__",
        "clamp",
        "square",
        "erf",
    )
)
_ELEMENTWISE = frozenset(
    (
        "add",
        "sub",
        "mul",
        "div",
        "true_divide",
        "pow",
        "where",
        "masked_fill",
        "maximum",
        "minimum",
        "__add__",
        "__radd__",
        "__iadd__",
        "__sub__",
        "__rsub__",
        "__isub__",
        "__mul__",
        "__rmul__",
        "__imul__",
        "__truediv__",
        "__rtruediv__",
        "__itruediv__",
        "__pow__",
        "__rpow__",
        "add_",
        "mul_",
        "sub_",
        "div_",
        "masked_fill_",
        "lerp",
        "addcmul",
    )
)
_NORMALIZING = frozenset({"softmax", "log_softmax", "_softmax"})
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm"})


@dataclass(frozen=True)
class _Split:
    """An activation split across ranks on ``dim`` (negative: from the end) in region
    ``region``; ``column`` the column linear it came straight from (None after ops)."""

    region: int
    dim: int
    column: str | None = None


@dataclass
class _RegionFacts:
    columns: dict[str, Column] = field(default_factory=dict)
    rows: list[str] = field(default_factory=list)
    column_inputs: list[torch.Tensor] = field(default_factory=list)
    row_outputs: list[torch.Tensor] = field(default_factory=list)
    conflict: str = ""
    output: bool = False


class _Deriver:
    def __init__(self, model: nn.Module, size: int) -> None:
        self.model, self.size = model, size
        self.split: dict[int, _Split] = {}
        self.parent: dict[int, int] = {}
        self.facts: dict[int, _RegionFacts] = {}
        self.embeddings: dict[str, torch.Tensor] = {}
        self.weights = _weight_owners(model)
        self.model_inputs: list[torch.Tensor] = []

    # regions, merged when their activations meet
    def find(self, region: int) -> int:
        while self.parent[region] != region:
            region = self.parent[region]
        return region

    def union(self, regions: Sequence[int]) -> int:
        roots = sorted({self.find(r) for r in regions})
        root = roots[0]
        for other in roots[1:]:
            self.parent[other] = root
            merged, into = self.facts.pop(other), self.facts[root]
            into.columns.update(merged.columns)
            into.rows.extend(merged.rows)
            into.column_inputs.extend(merged.column_inputs)
            into.row_outputs.extend(merged.row_outputs)
            into.conflict = into.conflict or merged.conflict
            into.output = into.output or merged.output
        return root

    def conflict(self, regions: Sequence[int], why: str) -> None:
        root = self.union(regions)
        self.facts[root].conflict = self.facts[root].conflict or why

    def state(self, t: torch.Tensor) -> _Split | None:
        found = self.split.get(id(t))
        return None if found is None else _Split(self.find(found.region), found.dim, found.column)

    def mark(self, t: torch.Tensor, region: int, dim: int, column: str | None = None) -> None:
        self.split[id(t)] = _Split(region, dim - t.dim() if dim >= 0 else dim, column)

    # one op
    def op(self, rec: OpRecord) -> None:
        name = getattr(rec.func, "__name__", str(rec.func))
        if not rec.outputs:
            return  # sizes, dtypes: nothing flows on
        if name == "linear" and self._linear(rec):
            return
        if name == "embedding" and self._embedding(rec):
            return
        states = [(t, s) for t in rec.inputs if (s := self.state(t)) is not None]
        if not states:
            return
        regions = [s.region for _, s in states]
        dims = {s.dim for _, s in states}
        where = f"{name} in {rec.stack[-1] if rec.stack else 'the model'}"
        if len(dims) != 1:
            return self.conflict(regions, f"{where} combines activations split on other dims")
        dim = dims.pop()
        root = self.union(regions)
        for out, out_dim in self._carry(name, rec, states[0][0], dim, where, root):
            column = states[0][1].column if name in ("chunk", "split", "unbind") else None
            self.mark(out, root, out_dim, column)

    def _carry(
        self, name: str, rec: OpRecord, x: torch.Tensor, dim: int, where: str, root: int
    ) -> list[tuple[torch.Tensor, int]]:
        """The outputs that stay split, each with its dim; a conflict otherwise."""
        outs = rec.outputs
        pos = dim + x.dim()
        if name in _SAME_SHAPE or name in _ELEMENTWISE:
            return self._elementwise(rec, dim, where, root)
        if name in _NORMALIZING:
            axis = _arg(rec, 1, "dim", -1)
            if axis is not None and axis % x.dim() == pos:
                self.conflict([root], f"{where} normalizes over the split dim")
                return []
            return [(outs[0], dim)]
        if name in ("view", "reshape", "flatten", "unflatten"):
            new = _new_dim(tuple(x.shape), tuple(outs[0].shape), pos)
            if new is None or outs[0].shape[new] % self.size:
                return self._bad_reshape(rec, x, outs[0], new, where, root)
            column = self.state(x)
            if column is not None and column.column and outs[0].dim() > x.dim():
                self._heads(column.column, int(outs[0].shape[new]), rec)
            return [(outs[0], new - outs[0].dim())]
        if name in ("transpose", "swapaxes", "permute", "movedim"):
            order = _permutation(rec, x.dim(), name)
            return [(outs[0], order.index(pos) - x.dim())]
        if name in ("chunk", "split", "unbind", "split_with_sizes", "tensor_split"):
            axis = _arg(rec, 2, "dim", 0) % x.dim()
            if axis == pos:
                return self._chunked(rec, x, where, root)
            if name == "unbind":
                return [(o, dim) for o in outs]
            return [(o, dim) for o in outs]
        if name in ("matmul", "bmm", "__matmul__", "baddbmm"):
            if pos >= x.dim() - 2:
                self.conflict([root], f"{where} contracts the split dim")
                return []
            return [(outs[0], dim)]
        if name == "scaled_dot_product_attention":
            return [(outs[0], dim)] if pos < x.dim() - 2 else self._refuse(root, where)
        if name in ("expand", "expand_as", "repeat_interleave", "unsqueeze", "squeeze"):
            return self._same_rank(rec, x, dim, where, root)
        if name == "__getitem__":
            new = _index_dim(rec.args[1], tuple(x.shape), pos)
            if new is None:
                return self._refuse(root, f"{where} indexes the split dim")
            return [(outs[0], new - outs[0].dim())]
        if name in ("cat", "stack", "concat"):
            axis = _arg(rec, 1, "dim", 0) % (x.dim() + (name == "stack"))
            if axis == pos and name != "stack":
                return self._refuse(root, f"{where} concatenates on the split dim")
            return [(outs[0], dim - (name == "stack" and axis > pos))]
        if name in _REDUCTIONS:
            axes = _arg(rec, 1, "dim", None)
            axes = tuple(range(x.dim())) if axes is None else axes
            axes = (axes,) if isinstance(axes, int) else tuple(axes)
            if pos in {a % x.dim() for a in axes}:
                return self._refuse(root, f"{where} reduces over the split dim")
            keep = bool(_arg(rec, 2, "keepdim", False))
            shift = 0 if keep else sum(1 for a in axes if a % x.dim() > pos)
            return [(outs[0], dim + shift)]
        return self._refuse(root, f"{where} (op {name}) is not known to keep the split dim apart")

    def _refuse(self, root: int, why: str) -> list[tuple[torch.Tensor, int]]:
        self.conflict([root], why)
        return []

    def _elementwise(
        self, rec: OpRecord, dim: int, where: str, root: int
    ) -> list[tuple[torch.Tensor, int]]:
        for t in rec.inputs:
            if self.state(t) is None and t.dim() >= -dim and t.shape[dim] != 1:
                return self._refuse(root, f"{where} meets a replicated tensor on the split dim")
        return [(o, dim) for o in rec.outputs if o.dim() >= -dim]

    def _same_rank(
        self, rec: OpRecord, x: torch.Tensor, dim: int, where: str, root: int
    ) -> list[tuple[torch.Tensor, int]]:
        out = rec.outputs[0]
        if out.dim() == x.dim() and out.shape[dim] != x.shape[dim]:
            return self._refuse(root, f"{where} changes the split dim")
        if out.dim() != x.dim():
            new = _new_dim(tuple(x.shape), tuple(out.shape), dim + x.dim())
            if new is None:
                return self._refuse(root, f"{where} moves the split dim")
            return [(out, new - out.dim())]
        return [(out, dim)]

    def _chunked(
        self, rec: OpRecord, x: torch.Tensor, where: str, root: int
    ) -> list[tuple[torch.Tensor, int]]:
        origin = self.state(x)
        sizes = {o.shape[-1] for o in rec.outputs}
        if origin is None or origin.column is None or len(sizes) != 1 or origin.dim != -1:
            return self._refuse(root, f"{where} splits the split dim")
        column = self.facts[root].columns[origin.column]
        chunks = len(rec.outputs)
        if sizes.pop() % self.size:
            return self._refuse(root, f"{where}: chunks of {origin.column} not divisible")
        self.facts[root].columns[origin.column] = Column(column.linear, chunks, column.heads)
        return [(o, -1) for o in rec.outputs]

    def _heads(self, column: str, heads: int, rec: OpRecord) -> None:
        for facts in self.facts.values():
            if column in facts.columns:
                old = facts.columns[column]
                facts.columns[column] = Column(old.linear, old.chunks, heads)

    def _bad_reshape(
        self,
        rec: OpRecord,
        x: torch.Tensor,
        out: torch.Tensor,
        new: int | None,
        where: str,
        root: int,
    ) -> list[tuple[torch.Tensor, int]]:
        origin = self.state(x)
        if new is not None and origin is not None and origin.column and out.dim() > x.dim():
            module = rec.stack[-1] if rec.stack else "the model"
            raise ConfigError(
                f"tensor parallelism: {module} views {origin.column}'s output as "
                f"{int(out.shape[new])} heads, which the tp axis of size {self.size} does not "
                "divide; pick a tp size that divides the head count (and the key/value "
                "head count), or leave this model on one tp rank"
            )
        return self._refuse(root, f"{where} reshapes the split dim")

    def _linear(self, rec: OpRecord) -> bool:
        x, weight = _arg(rec, 0, "input", None), _arg(rec, 1, "weight", None)
        owner = self._owner(weight, rec, nn.Linear)
        if owner is None or not isinstance(x, torch.Tensor):
            return False
        state = self.state(x)
        out = rec.outputs[0]
        if state is None:
            region = len(self.parent)
            self.parent[region] = region
            self.facts[region] = _RegionFacts({owner: Column(owner)}, column_inputs=[x])
            if weight.shape[0] % self.size:
                self.facts[
                    region
                ].conflict = f"{weight.shape[0]} output features not divisible by {self.size}"
            self.mark(out, region, -1, owner)
        elif state.dim == -1:
            facts = self.facts[state.region]
            facts.rows.append(owner)
            facts.row_outputs.append(out)
        else:
            self.conflict([state.region], f"{owner} gets an input split on another dim")
        return True

    def _embedding(self, rec: OpRecord) -> bool:
        weight = _arg(rec, 1, "weight", None)
        owner = self._owner(weight, rec, nn.Embedding)
        if owner is None:
            return False
        ids = _arg(rec, 0, "input", None)
        if weight.shape[0] % self.size == 0 and any(ids is t for t in self.model_inputs):
            self.embeddings[owner] = rec.outputs[0]  # a vocabulary, looked up by the input
        return True

    def _owner(self, weight: Any, rec: OpRecord, kind: type[nn.Module]) -> str | None:
        if not isinstance(weight, nn.Parameter):
            return None
        for module in reversed(rec.stack):
            if (module, id(weight)) in self.weights and isinstance(
                self.model.get_submodule(module), kind
            ):
                return module
        return None


def derive_plan(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    size: int,
    *,
    sequence_parallel: bool,
) -> TensorPlan:
    """The tensor-parallel plan of ``model`` over ``size`` ranks from one forward on
    ``args`` / ``kwargs`` (see the module; a ConfigError for a head count ``size`` does
    not divide)."""
    recorded = record_forward(model, args, kwargs)
    deriver = _Deriver(model, size)
    deriver.model_inputs = list(recorded.calls[0].args.values()) if recorded.calls else []
    for rec in recorded.ops:
        deriver.op(rec)
    for out in recorded.outputs:
        state = deriver.state(out)
        if state is not None:
            deriver.facts[state.region].output = True
    return _assemble(model, deriver, recorded, size, sequence_parallel)


def _assemble(
    model: nn.Module,
    deriver: _Deriver,
    recorded: RecordedForward,
    size: int,
    sequence_parallel: bool,
) -> TensorPlan:
    regions: list[Region] = []
    heads: list[VocabLayer] = []
    replicated: list[tuple[str, str]] = []
    for facts in deriver.facts.values():
        linears = [*facts.columns, *facts.rows]
        if facts.conflict:
            replicated += [(name, facts.conflict) for name in linears]
        elif facts.output and not facts.rows and len(facts.columns) == 1:
            head = next(iter(facts.columns))
            out = recorded.outputs[0]
            heads.append(VocabLayer(head, tuple(out.shape), dtype_name(out.dtype)))
        elif facts.output or not facts.rows:
            why = "its output leaves the model split" if facts.output else "no row linear"
            replicated += [(name, why) for name in linears]
        else:
            regions.append(_region(facts, recorded.calls, model))
    embeddings = [
        VocabLayer(name, tuple(out.shape), dtype_name(out.dtype))
        for name, out in deriver.embeddings.items()
    ]
    embeddings, heads = _tied_agree(model, embeddings, heads, replicated)
    plan = TensorPlan(
        size, tuple(regions), tuple(embeddings), tuple(heads), replicated=tuple(replicated)
    )
    if not sequence_parallel:
        return plan
    return _with_sequence(plan, recorded, model)


def _region(facts: _RegionFacts, calls: list[ModuleCall], model: nn.Module) -> Region:
    """The region's module (the innermost holding all its linears), its entry argument
    and the activations' shapes."""
    names = [*facts.columns, *facts.rows]
    module = _common_prefix(names)
    call = next(c for c in calls if c.name == module)
    entry = _entry(call, facts.column_inputs[0])
    out = call.outputs[0] if call.outputs else facts.row_outputs[0]
    single = len(facts.rows) == 1 and tuple(facts.row_outputs[0].shape) == tuple(out.shape)
    reduce = "scatter" if single else "sum"
    x = facts.column_inputs[0]
    return Region(
        module,
        tuple(facts.columns.values()),
        tuple(Row(r, reduce) for r in facts.rows),
        entry,
        tuple(x.shape),
        tuple(out.shape),
        dtype_name(x.dtype),
        owned={
            n
            for n, m in model.get_submodule(module).named_modules(prefix=module)
            if isinstance(m, nn.Linear)
        }
        == set(names),
    )


def _entry(call: ModuleCall, column_input: torch.Tensor) -> int | str:
    for key, tensor in call.args.items():
        if tensor is column_input:
            return key
    return next(iter(call.args), 0)


def _common_prefix(names: Sequence[str]) -> str:
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if len(names) == 1:
        common = common[:-1]
    return ".".join(common)


def _tied_agree(
    model: nn.Module,
    embeddings: list[VocabLayer],
    heads: list[VocabLayer],
    replicated: list[tuple[str, str]],
) -> tuple[list[VocabLayer], list[VocabLayer]]:
    """A weight shared by an embedding and a head is split only when both are."""
    weight_of = {
        layer.module: id(model.get_submodule(layer.module).weight)
        for layer in [*embeddings, *heads]
    }
    parallel = set(weight_of)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and name not in parallel:
            for layer, wid in weight_of.items():
                if wid == id(weight):
                    replicated.append((layer, f"its weight is shared with {name}, replicated"))
                    parallel.discard(layer)
    return [e for e in embeddings if e.module in parallel], [
        h for h in heads if h.module in parallel
    ]


def _with_sequence(plan: TensorPlan, recorded: RecordedForward, model: nn.Module) -> TensorPlan:
    """``plan`` with sequence parallelism: the activations between regions followed as
    sequence slices (see the module); a ConfigError naming an op that mixes tokens."""
    if not plan.regions:
        return plan
    first = plan.regions[0].module
    split_at = _block_of(first, model)
    # regions with a module of their own (gathered entering it) or whose output is summed
    # whole are followed as wholes; the others start at their column linears (each
    # gathers) and end at their row linear (reduce-scattered onto the slices)
    whole = {r.module for r in plan.regions if r.owned or any(w.reduce == "sum" for w in r.rows)}
    boundaries = whole | {h.module for h in plan.heads}
    columns, rows = plan.columns(), plan.rows()
    split_call = next(c for c in recorded.calls if c.name == split_at)
    entry = next(iter(split_call.args.values()))
    if entry.dim() < 2 or entry.shape[1] % plan.size:
        raise ConfigError(
            f"sequence parallelism: {split_at}'s input {tuple(entry.shape)} has a sequence "
            f"(dim 1) that tp={plan.size} does not divide; pad the sequence to a multiple of "
            f"{plan.size} or pass sequence_parallel=False"
        )
    exits = {c.end: c for c in recorded.calls if c.name in boundaries}
    sliced: set[int] = {id(entry)}
    modules: list[str] = []
    inside_until = -1
    for index, rec in enumerate(recorded.ops):
        call = exits.get(index)
        if call is not None:
            sliced.update(id(t) for t in call.outputs)
        if index < inside_until:
            continue
        opened = [c for c in recorded.calls if c.start == index and c.name in boundaries]
        if opened:
            inside_until = max(c.end for c in opened)
            if index < inside_until:
                continue
        name = getattr(rec.func, "__name__", str(rec.func))
        owner = rec.stack[-1] if rec.stack else ""
        if name == "linear" and owner in columns:
            continue  # into a region: gathered, its activations whole
        if name == "linear" and owner in rows:
            sliced.update(id(t) for t in rec.outputs)  # reduce-scattered onto the slices
            continue
        if not rec.outputs or not any(id(t) in sliced for t in rec.inputs):
            continue
        if not _token_wise(name, rec):
            where = rec.stack[-1] if rec.stack else "the model"
            raise ConfigError(
                f"sequence parallelism: {name} in {where} works across tokens on the "
                "sequence slices; pass sequence_parallel=False"
            )
        sliced.update(id(t) for t in rec.outputs)
        if any(isinstance(t, nn.Parameter) for t in rec.inputs) and owner not in modules:
            modules.append(owner)
    if any(id(t) in sliced for t in recorded.outputs):
        return plan  # the output would leave the model as slices: no split
    embedded = {
        id(t)
        for c in recorded.calls
        if c.name in {e.module for e in plan.embeddings}
        for t in c.outputs
    }
    return TensorPlan(
        plan.size,
        plan.regions,
        plan.embeddings,
        plan.heads,
        True,
        split_at,
        tuple(modules),
        plan.replicated,
        plan.source,
        split_at_embedding=id(entry) in embedded,
    )


def _token_wise(name: str, rec: OpRecord) -> bool:
    """Whether ``rec`` treats each token apart (on a ``(batch, sequence, ...)`` slice)."""
    if name in _SAME_SHAPE or name in _ELEMENTWISE or name in ("layer_norm", "rms_norm"):
        return True
    x = rec.inputs[0]
    if name in _REDUCTIONS:
        axes = _arg(rec, 1, "dim", None)
        axes = (axes,) if isinstance(axes, int) else axes
        return axes is not None and all(a % x.dim() >= 2 for a in axes)
    if name == "__getitem__":
        out = rec.outputs[0]
        return _index_dim(rec.args[1], tuple(x.shape), 1) == 1 and out.shape[:2] == x.shape[:2]
    if name in ("linear", "zeros_like", "ones_like", "full_like", "empty_like"):
        return True  # a replicated linear works on each token apart
    along = _TOKEN_WISE_ALONG.get(name)
    if along is not None:
        axis = _arg(rec, along, "dim", -1)
        return axis is not None and axis % x.dim() >= 2
    return False


#: Ops that treat each token apart when their ``dim`` (argument position here) is not
#: the batch or the sequence.
_TOKEN_WISE_ALONG = {
    "softmax": 1,
    "log_softmax": 1,
    "topk": 2,
    "scatter": 1,
    "gather": 1,
    "argmax": 1,
    "sort": 1,
    "cumsum": 1,
}


def _block_of(module: str, model: nn.Module) -> str:
    """The block (an element of a ModuleList or Sequential) that holds ``module``."""
    parts = module.split(".")
    for depth in range(1, len(parts)):
        parent = model.get_submodule(".".join(parts[: depth - 1])) if depth > 1 else model
        child = getattr(parent, parts[depth - 1])
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            return ".".join(parts[: depth + 1])
    return module


def _weight_owners(model: nn.Module) -> set[tuple[str, int]]:
    return {
        (name, id(module.weight))
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), nn.Parameter)
    }


def _arg(rec: OpRecord, index: int, name: str, default: Any) -> Any:
    if name in rec.kwargs:
        return rec.kwargs[name]
    return rec.args[index] if len(rec.args) > index else default


def _new_dim(old: tuple[int, ...], new: tuple[int, ...], pos: int) -> int | None:
    """Where dim ``pos`` of shape ``old`` lands in ``new`` after a reshape, if it leads
    its group of merged or split dims (None otherwise)."""
    before = 1
    for size in old[:pos]:
        before *= size
    running = 1
    for index, size in enumerate(new):
        if running == before and size != 1:
            return index
        running *= size
        if running > before:
            return None
    return None


def _permutation(rec: OpRecord, rank: int, name: str) -> list[int]:
    """New position -> old dim, for transpose / permute / movedim."""
    order = list(range(rank))
    if name in ("transpose", "swapaxes"):
        a, b = (_arg(rec, 1, "dim0", 0) % rank, _arg(rec, 2, "dim1", 1) % rank)
        order[a], order[b] = order[b], order[a]
        return order
    if name == "permute":
        dims = rec.args[1:] if len(rec.args) > 2 else rec.args[1]
        return [d % rank for d in dims]
    src, dst = _arg(rec, 1, "source", 0) % rank, _arg(rec, 2, "destination", 0) % rank
    order.remove(src)
    order.insert(dst, src)
    return order


def _index_dim(index: Any, shape: tuple[int, ...], pos: int) -> int | None:
    """Where dim ``pos`` of ``shape`` lands after ``x[index]`` (None: the index takes part
    of it)."""
    rank = len(shape)
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (torch.Tensor, list)) for i in items):
        return None
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    in_dim, out_dim = 0, 0
    for item in items:
        if item is Ellipsis:
            skip = rank - consumed
            if in_dim <= pos < in_dim + skip:
                return out_dim + pos - in_dim
            in_dim, out_dim = in_dim + skip, out_dim + skip
        elif item is None:
            out_dim += 1
        elif isinstance(item, int):
            if in_dim == pos:
                return None
            in_dim += 1
        else:  # a slice
            if in_dim == pos:
                full = item.indices(shape[pos]) == (0, shape[pos], 1)
                return out_dim if full else None
            in_dim, out_dim = in_dim + 1, out_dim + 1
    return out_dim + pos - in_dim
