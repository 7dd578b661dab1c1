"""The tensor-parallel plan derived from one recorded forward: :func:`derive_plan`.

Every activation is followed op by op (:mod:`.trace`) with the dimension it would be
split on. A linear fed a replicated activation starts a region (column-parallel: its
output features split); ops that keep the split dimension apart (elementwise, views that
split features into heads, transposes, attention, matmuls over heads) carry it on; a
linear fed the split features ends the region (row-parallel). Each op is asked which
dimension it mixes (a norm its last dims, ``view_as_complex`` the pair it makes complex,
``repeat_interleave`` none within a slice); an op without a rule is run again on each
slice of its split inputs and kept where every slice gives that slice of its output. So
head-local ops (complex or cos/sin rotary, per-head q/k norms, per-head scaling) split
with the heads; the whole parameters they apply are listed, their gradients summed over
the group, and sizes of the split dim the code writes whole (``split([q, kv, kv])``) are
listed to be scaled to the slice. A region reached by an op that would mix the split
dimension (a norm over it, a reduction) stays replicated, with the op and its module
named. A region that reaches the model's output is a vocabulary-parallel head; an
embedding whose vocabulary ``tp`` divides is vocabulary-parallel. A view that splits a
column's output into a head count ``tp`` does not divide is a one-line ConfigError,
raised here, before any collective.

With sequence parallelism, the activations between regions are followed as sequence
slices from the first block that holds a region (in any container of blocks): only
token-wise ops may touch them, or a module that, run on each slice, gives that slice of
its output (a router and its experts); the modules whose parameters they meet (norms)
have their gradients summed. A replicated region met there is a one-line error naming the
op that kept it replicated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils import _pytree as pytree

from lamina.dtypes import dtype_name
from lamina.errors import ConfigError
from lamina.graph.blocks import block_holding
from lamina.graph.state import preserved
from lamina.strategies.tp.given import (
    check_styles,
    differences,
    given_layers,
    given_role,
    wants_sequence_parallel,
)
from lamina.strategies.tp.layers import (
    Column,
    Region,
    Row,
    TensorPlan,
    VocabLayer,
    WrittenSize,
)
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
#: Norms over their input's last ``len(normalized_shape)`` dims.
_NORMS = frozenset({"layer_norm", "rms_norm"})
#: Ops that cut a tensor into parts (a fused projection's q, k, v).
_PARTS = frozenset({"chunk", "split", "unbind", "split_with_sizes"})
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
    #: Modules whose parameters meet the region's split activations, with the dim their
    #: input is split on.
    shared: list[tuple[str, int]] = field(default_factory=list)
    written: list[WrittenSize] = field(default_factory=list)


class _Deriver:
    def __init__(self, model: nn.Module, size: int) -> None:
        self.model, self.size = model, size
        self.split: dict[int, _Split] = {}
        self.parent: dict[int, int] = {}
        self.facts: dict[int, _RegionFacts] = {}
        self.embeddings: dict[str, torch.Tensor] = {}
        self.weights = _weight_owners(model)
        self.model_inputs: list[torch.Tensor] = []
        #: A plan given as torch styles: only its layers are split (see :func:`derive_plan`).
        self.given: Mapping[str, ParallelStyle] | None = None

    def _origin(self, x: torch.Tensor) -> str:
        """The column-parallel layers whose split output ``x`` is (for errors)."""
        state = self.state(x)
        return "" if state is None else ", ".join(self.facts[state.region].columns)

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
            into.shared += [m for m in merged.shared if m not in into.shared]
            into.written += merged.written
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
        carried = self._carry(name, rec, states[0][0], dim, where, root)
        for out, out_dim in carried:
            column = states[0][1].column if name in _PARTS else None
            self.mark(out, root, out_dim, column)
        if carried:
            x = states[0][0]
            self._shared(rec, self.find(root), dim % x.dim())

    def _shared(self, rec: OpRecord, root: int, dim: int) -> None:
        """The modules whose parameters ``rec`` applies to activations split on ``dim``:
        each rank holds them whole and computes part of their gradient."""
        known = {name for name, _ in self.facts[root].shared}
        for t in rec.inputs:
            if isinstance(t, nn.Parameter) and self.state(t) is None:
                owner = self._param_module(t, rec)
                if owner is not None and owner not in known:
                    self.facts[root].shared.append((owner, dim))
                    known.add(owner)

    def _param_module(self, param: nn.Parameter, rec: OpRecord) -> str | None:
        for module in reversed(rec.stack):
            if any(p is param for p in self.model.get_submodule(module)._parameters.values()):
                return module
        return None

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
        if name in _NORMS:
            shape = _arg(rec, 1, "normalized_shape", ())
            span = 1 if isinstance(shape, int) else len(shape)
            if pos >= x.dim() - span:
                return self._refuse(root, f"{where} normalizes over the split dim")
            return [(outs[0], dim)]
        if name == "view_as_complex":  # the last dim (re, im pairs) goes
            return (
                self._refuse(root, f"{where} pairs the split dim")
                if dim == -1
                else [(outs[0], dim + 1)]
            )
        if name == "view_as_real":  # a last dim (re, im) comes
            return [(outs[0], dim - 1)]
        if name in ("view", "reshape", "flatten", "unflatten"):
            new = _new_dim(tuple(x.shape), tuple(outs[0].shape), pos)
            if new is None or outs[0].shape[new] % self.size:
                return self._bad_reshape(rec, x, outs[0], new, where, root)
            column = self.state(x)
            if column is not None and column.column and outs[0].dim() > x.dim():
                self._heads(column.column, int(outs[0].shape[new]), rec)
            self._written_shape(rec, x, pos, outs[0], new, root)
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
        if name == "repeat_interleave" and _arg(rec, 2, "dim", None) is not None:
            axis, repeats = _arg(rec, 2, "dim", None) % x.dim(), _arg(rec, 1, "repeats", None)
            if axis == pos and isinstance(repeats, int):  # each slice's rows repeated in it
                return [(outs[0], dim)]
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
        probed = self._probe(rec, name)
        if probed is not None:
            return probed
        out = outs[0]
        if self.given is not None and out.dim() == x.dim() and out.shape[pos] == x.shape[pos]:
            return [(out, dim)]  # a given plan runs it on the slice, as torch does
        return self._refuse(root, f"{where} does not keep the split dim apart")

    def _probe(self, rec: OpRecord, name: str) -> list[tuple[torch.Tensor, int]] | None:
        """``rec``'s output split on the one dim where running the op on each slice of its
        split inputs gives that slice of its output (None: no such dim, or the op cannot
        be rerun: in place, or shapes without values)."""
        out = rec.outputs[0] if len(rec.outputs) == 1 else None
        if out is None or name.endswith("_") or "out" in rec.kwargs:
            return None
        if out.is_meta or any(t.is_meta for t in rec.inputs):
            return None

        found: int | None = None
        for index in range(self.size):
            got = self._on_slice(rec, index)
            if not isinstance(got, torch.Tensor) or got.dim() != out.dim():
                return None
            moved = [i for i in range(out.dim()) if got.shape[i] != out.shape[i]]
            if len(moved) != 1 or got.shape[moved[0]] * self.size != out.shape[moved[0]]:
                return None
            if found is not None and moved[0] != found:
                return None
            found = moved[0]
            want = out.narrow(found, index * got.shape[found], got.shape[found])
            same = (
                torch.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
                if got.is_floating_point() or got.is_complex()
                else torch.equal(got, want)
            )
            if not same:
                return None
        return None if found is None else [(out, found - out.dim())]

    def _on_slice(self, rec: OpRecord, index: int) -> Any:
        """``rec``'s op rerun on slice ``index`` of its split inputs (None: it fails)."""

        def cut(value: Any) -> Any:
            state = self.state(value) if isinstance(value, torch.Tensor) else None
            if state is None:
                return value
            width = value.shape[state.dim] // self.size
            return value.narrow(state.dim, index * width, width).contiguous()

        try:
            with torch.no_grad():
                return rec.func(*pytree.tree_map(cut, rec.args), **pytree.tree_map(cut, rec.kwargs))
        except Exception:  # the op does not run on a slice: it does not keep it apart
            return None

    def _written_shape(
        self, rec: OpRecord, x: torch.Tensor, pos: int, out: torch.Tensor, new: int, root: int
    ) -> None:
        """A view/reshape whose arguments write the split dim's whole size: one that
        gives it a new size (features viewed as heads); a size equal to the input's is
        read off it (``x.shape[:-1]``) and is the slice's own on each rank."""
        name = getattr(rec.func, "__name__", "")
        if name not in ("view", "reshape"):
            return
        sizes = _shape_args(rec)
        if sizes is None or len(sizes) != out.dim() or sizes[new] != out.shape[new]:
            return  # -1 there: the slice's own size
        if out.shape[new] == x.shape[pos]:
            return
        module = rec.stack[-1] if rec.stack else ""
        self.facts[root].written.append(WrittenSize(module, name, sizes, new))

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
        if origin is None or origin.column is None or origin.dim != -1:
            return self._refuse(root, f"{where} splits the split dim")
        sizes = tuple(int(o.shape[-1]) for o in rec.outputs)
        if any(size % self.size for size in sizes):
            return self._refuse(
                root, f"{where}: the parts {list(sizes)} of {origin.column} not divisible"
            )
        column = self.facts[root].columns[origin.column]
        sections = sizes if len(set(sizes)) > 1 else ()
        self.facts[root].columns[origin.column] = Column(
            column.linear, len(sizes), column.heads, sections
        )
        name = getattr(rec.func, "__name__", "")
        written = _arg(rec, 1, "split_size_or_sections", None)
        if name in ("split", "split_with_sizes") and written is not None:
            module = rec.stack[-1] if rec.stack else ""
            listed = (written,) if isinstance(written, int) else tuple(written)
            self.facts[root].written.append(WrittenSize(module, name, listed))
        return [(o, -1) for o in rec.outputs]

    def _heads(self, column: str, heads: int, rec: OpRecord) -> None:
        for facts in self.facts.values():
            if column in facts.columns:
                old = facts.columns[column]
                most = max(old.heads, heads)
                facts.columns[column] = Column(old.linear, old.chunks, most, old.sections)

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
        if self.given is not None:
            given_role(self.given, owner, state is not None and state.dim == -1, self._origin(x))
            if state is None and owner not in self.given:
                return True  # whole on every rank
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
    given: Mapping[str, ParallelStyle] | None = None,
) -> TensorPlan:
    """The tensor-parallel plan of ``model`` over ``size`` ranks from one forward on
    ``args`` / ``kwargs`` (see the module; a ConfigError for a head count ``size`` does
    not divide).

    With ``given`` (torch ``ParallelStyle`` objects by module name), the plan is the one
    they give, applied as torch applies it: only the layers they name are split, the
    ops between run on the slices, sequence parallelism as they ask. It is checked for
    what makes it inconsistent (a row-parallel layer whose input is not split, a layer
    without a style fed a split activation, an op that mixes the split dim, a size the
    tp size does not divide), each a one-line ConfigError, and carries how it differs
    from the derived plan (``differences``: ``lamina plan --explain`` prints them)."""
    recorded = record_forward(model, args, kwargs)
    if given is None:
        return _derive(model, recorded, size, sequence_parallel, None)
    check_styles(given, model)
    sequence = wants_sequence_parallel(given)
    try:
        derived: TensorPlan | str = _derive(model, recorded, size, sequence, None)
    except ConfigError as refused:  # the given plan may still be consistent
        derived = str(refused)
    plan = _derive(model, recorded, size, sequence, given)
    return replace(
        plan,
        source="given as torch ParallelStyle objects",
        differences=differences(given, derived),
    )


def _derive(
    model: nn.Module,
    recorded: RecordedForward,
    size: int,
    sequence_parallel: bool,
    given: Mapping[str, ParallelStyle] | None,
) -> TensorPlan:
    deriver = _Deriver(model, size)
    deriver.given = given
    deriver.model_inputs = list(recorded.calls[0].args.values()) if recorded.calls else []
    for rec in recorded.ops:
        deriver.op(rec)
    for out in recorded.outputs:
        state = deriver.state(out)
        if state is not None:
            deriver.facts[state.region].output = True
    plan = _assemble(model, deriver, recorded, size, sequence_parallel and given is None)
    if given is None:
        return plan
    plan = given_layers(plan, given, model)
    return _with_sequence(plan, recorded, model) if sequence_parallel else plan


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
    shared: list[tuple[str, int]] = []
    written: list[WrittenSize] = []
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
            shared += [m for m in facts.shared if m not in shared]
            written += [w for w in facts.written if w not in written]
    regions = _own_modules(regions, replicated)
    embeddings = [
        VocabLayer(name, tuple(out.shape), dtype_name(out.dtype))
        for name, out in deriver.embeddings.items()
    ]
    embeddings, heads = _tied_agree(model, embeddings, heads, replicated)
    plan = TensorPlan(
        size,
        tuple(regions),
        tuple(embeddings),
        tuple(heads),
        replicated=tuple(replicated),
        shared_modules=tuple(shared),
        written_sizes=tuple(written),
    )
    if not sequence_parallel:
        return plan
    return _with_sequence(plan, recorded, model)


def _own_modules(regions: list[Region], replicated: list[tuple[str, str]]) -> list[Region]:
    """The regions each held by a module of its own: two whose innermost common module
    is the same (column and row linears of two pairs under one container) cannot have
    that module's input gathered and its gradient summed for each, so their linears stay
    replicated, the reason saying how to split them."""
    holders = [r.module for r in regions]
    kept = []
    for region in regions:
        if holders.count(region.module) == 1:
            kept.append(region)
            continue
        where = region.module or "the model itself"
        why = (
            f"another split region is held by the same module ({where}); put each "
            "column/row pair in a module of its own"
        )
        replicated += [(name, why) for name in region.linears()]
    return kept


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
        positional=1 + max((k for k in call.args if isinstance(k, int)), default=0),
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
    split_at = block_holding(model, first)
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
            whole_call = _token_wise_call(index, recorded, sliced, boundaries, model, plan.size)
            if whole_call is None:
                where = rec.stack[-1] if rec.stack and rec.stack[-1] else "the model"
                raise ConfigError(_across_tokens(name, where, plan))
            # a module that treats each token apart as a whole (a router and its experts)
            sliced.update(id(t) for t in whole_call.outputs)
            inside_until = whole_call.end
            held = model.get_submodule(whole_call.name).named_modules(prefix=whole_call.name)
            modules += [
                n for n, m in held if n not in modules and any(True for _ in m.parameters(False))
            ]
            continue
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
    # the embedding can give the slices only if nothing but the first block reads its
    # output (Hugging Face models read its sequence length for positions and the mask)
    read_before = any(
        any(t is entry for t in rec.inputs) for rec in recorded.ops[: split_call.start]
    )
    return replace(
        plan,
        sequence_parallel=True,
        split_at=split_at,
        sequence_modules=tuple(modules),
        split_at_embedding=id(entry) in embedded and not read_before,
    )


def _token_wise_call(
    index: int,
    recorded: RecordedForward,
    sliced: set[int],
    boundaries: set[str],
    model: nn.Module,
    size: int,
) -> ModuleCall | None:
    """The innermost module call around op ``index`` that treats each token apart as a
    whole: fed sequence slices, and run again on each slice (no gradients, state kept)
    it gives that slice of its recorded output. None: no such call."""
    around = [c for c in recorded.calls if c.start <= index < c.end and c.name]
    for call in reversed(around):
        inner = [c for c in recorded.calls if call.start <= c.start < call.end]
        if any(c.name in boundaries for c in inner):
            return None  # holds a split region: not a token-wise whole
        if any(id(t) in sliced for t in call.args.values()) and _slices_agree(
            call, sliced, model, size
        ):
            return call
    return None


def _slices_agree(call: ModuleCall, sliced: set[int], model: nn.Module, size: int) -> bool:
    out = call.outputs[0] if call.outputs else None
    if out is None or out.is_meta or out.dim() < 2 or out.shape[1] % size:
        return False
    module = model.get_submodule(call.name)
    for index in range(size):

        def cut(value: Any, index: int = index) -> Any:
            if not isinstance(value, torch.Tensor) or id(value) not in sliced:
                return value
            width = value.shape[1] // size
            return value.narrow(1, index * width, width).contiguous()  # as a slice arrives

        try:
            with preserved(model), torch.no_grad():
                got = module(
                    *pytree.tree_map(cut, call.raw_args), **pytree.tree_map(cut, call.raw_kwargs)
                )
        except Exception:  # it does not run on a slice
            return False
        leaves = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
        width = out.shape[1] // size
        want = out.narrow(1, index * width, width)
        if not leaves or leaves[0].shape != want.shape:
            return False
        # rounding scales with the output (weights drawn at std 1 give outputs of 1e3,
        # whose sums cancel to small entries with 1e-4 of rounding); a module mixing
        # tokens differs by the output's own size
        scale = float(want.abs().max()) if want.numel() else 0.0
        if not torch.allclose(leaves[0], want, rtol=1e-5, atol=1e-6 * max(1.0, scale)):
            return False
    return True


def _across_tokens(name: str, where: str, plan: TensorPlan) -> str:
    """The error for op ``name`` in module ``where`` working across the sequence slices:
    naming, when a replicated region holds it, the op that kept that region whole."""
    parts = where.split(".")

    def shared(linear: str) -> int:
        depth = 0
        for a, b in zip(parts, linear.split("."), strict=False):
            if a != b:
                break
            depth += 1
        return depth

    nearest = max(plan.replicated, key=lambda item: shared(item[0]), default=None)
    if nearest is None or shared(nearest[0]) == 0:
        return (
            f"sequence parallelism: {name} in {where} works across tokens on the sequence "
            "slices; pass sequence_parallel=False"
        )
    linear, why = nearest
    return (
        f"sequence parallelism: {linear} stays replicated ({why}), so {name} in {where} "
        "would work across tokens on the sequence slices; make that op act within a "
        "head (or a feature slice), or pass sequence_parallel=False"
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


def _shape_args(rec: OpRecord) -> tuple[int, ...] | None:
    """The sizes a view/reshape was called with, if all are ints."""
    given = rec.kwargs.get("shape", rec.kwargs.get("size"))
    if given is None:
        given = rec.args[1] if len(rec.args) == 2 else rec.args[1:]
    if isinstance(given, int):
        given = (given,)
    if not isinstance(given, (tuple, list, torch.Size)) or not all(
        isinstance(v, int) for v in given
    ):
        return None
    return tuple(int(v) for v in given)


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
