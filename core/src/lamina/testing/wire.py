"""Count what is handed to ``torch.distributed``: the bytes and dtype of every tensor a
collective or point-to-point call is given, per call, measured where they cross.

``with WireCounter() as wire: ...`` replaces, for the block, the functions of
:data:`COUNTED` on ``torch.distributed`` and ``torch.distributed.distributed_c10d`` by
wrappers that record each call and then call the real function. lamina looks them up
on the module at call time (``dist.all_reduce(...)``), so everything it issues is seen,
from any thread (its worker threads included). A call made by a counted function to
another one (``all_gather_into_tensor`` -> ``all_gather_single``, ``send`` -> ``isend``)
is counted once, as the outer call; so is a call through another wrapper of the same
function (:mod:`lamina.trace.user_collectives`), whichever was installed first.

Sizes follow the trace's convention (nccl-tests'): an all_reduce, broadcast, reduce,
send or recv counts its tensor, an all_gather its output, a reduce_scatter and an
all_to_all their input. :meth:`WireCounter.sent` turns them into the bytes a rank sends
on average with a bandwidth-optimal algorithm (an all-reduce moves its buffer twice).

Not seen: methods called on a process group object directly (``pg.allreduce([t])``),
functional collectives (``torch.distributed._functional_collectives``, which DTensor
uses) and names bound before the block (``from torch.distributed import all_reduce``).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lamina.dtypes import dtype_name

__all__ = ["COUNTED", "WireCounter", "WireRecord", "sent_share"]

#: function name -> (op recorded, the argument whose tensors are counted).
COUNTED: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
}


def sent_share(op: str, n: int) -> float:
    """Of a group of ``n`` ranks, the share of an op's counted bytes a rank sends on
    average with a bandwidth-optimal algorithm: an all-reduce is a reduce-scatter and an
    all-gather of its buffer, ``2(n-1)/n``; a send all of it, a receive nothing; every
    other op ``(n-1)/n`` (a broadcast sends ``n-1`` copies over the group, as an
    all-gather does)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("send", "recv"):
        return 1.0 if op == "send" else 0.0
    return (n - 1) / n


@dataclass(frozen=True)
class WireRecord:
    """The tensors of one dtype handed to one call: ``op`` (``all_gather``), ``form``
    (the function called: ``all_gather_into_tensor``), ``dtype`` (``uint8``), ``numel``
    and ``bytes`` (``numel x element_size``), the global ranks of its ``group`` (empty
    when the group is not registered with torch), and ``call``, the call's number."""

    op: str
    form: str
    dtype: str
    numel: int
    bytes: int
    group: tuple[int, ...]
    call: int

    @property
    def group_size(self) -> int:
        """Ranks in the call's group."""
        return len(self.group)

    def sent(self) -> float:
        """Bytes a rank of the group sends for this record on average (see the module
        docstring)."""
        return self.bytes * sent_share(self.op, max(1, self.group_size))


class WireCounter:
    """Records every call to ``torch.distributed`` made on this process, from any thread,
    while the block runs (see the module docstring); counters may nest."""

    def __init__(self) -> None:
        self._records: list[WireRecord] = []
        self._calls = 0
        self._lock = threading.Lock()

    def __enter__(self) -> WireCounter:
        _start(self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _stop(self)

    # -- recording --------------------------------------------------------------------
    def _record(self, op: str, form: str, tensors: list[torch.Tensor], group: Any) -> None:
        ranks = _group_ranks(group)
        by_dtype: dict[str, list[int]] = {}
        for tensor in tensors:
            totals = by_dtype.setdefault(dtype_name(tensor.dtype), [0, 0])
            totals[0] += tensor.numel()
            totals[1] += tensor.numel() * tensor.element_size()
        with self._lock:
            call = self._calls
            self._calls += 1
            for dtype, (numel, nbytes) in by_dtype.items():
                self._records.append(WireRecord(op, form, dtype, numel, nbytes, ranks, call))

    # -- reading ----------------------------------------------------------------------
    @property
    def records(self) -> list[WireRecord]:
        """Every record so far, in call order."""
        with self._lock:
            return list(self._records)

    def select(
        self,
        op: str | Iterable[str] | None = None,
        dtype: str | torch.dtype | Iterable[str | torch.dtype] | None = None,
        group: Iterable[int] | None = None,
        form: str | None = None,
    ) -> list[WireRecord]:
        """The records of ``op`` (one name or several), ``dtype`` (a name, a torch dtype
        or several), the ``group`` of these global ranks (any order) and ``form``; None
        matches all."""
        ops = _names(op)
        dtypes = None if dtype is None else {_dtype(d) for d in _many(dtype)}
        ranks = None if group is None else tuple(sorted(group))
        return [
            r
            for r in self.records
            if (ops is None or r.op in ops)
            and (dtypes is None or r.dtype in dtypes)
            and (ranks is None or tuple(sorted(r.group)) == ranks)
            and (form is None or r.form == form)
        ]

    def bytes(self, **where: Any) -> int:
        """Bytes of the records :meth:`select` picks with ``where``."""
        return sum(r.bytes for r in self.select(**where))

    def sent(self, **where: Any) -> float:
        """Bytes a rank sends on average for the records picked with ``where``."""
        return sum(r.sent() for r in self.select(**where))

    def calls(self, **where: Any) -> int:
        """Calls with at least one record picked with ``where``."""
        return len({r.call for r in self.select(**where)})

    def dtypes(self, **where: Any) -> set[str]:
        """Names of the dtypes of the records picked with ``where``."""
        return {r.dtype for r in self.select(**where)}

    def by_dtype(self, **where: Any) -> dict[str, int]:
        """Bytes per dtype name of the records picked with ``where``."""
        totals: dict[str, int] = {}
        for r in self.select(**where):
            totals[r.dtype] = totals.get(r.dtype, 0) + r.bytes
        return totals


def _many(value: Any) -> list[Any]:
    if isinstance(value, (str, torch.dtype)):
        return [value]
    return list(value)


def _names(value: str | Iterable[str] | None) -> set[str] | None:
    return None if value is None else set(_many(value))


def _dtype(value: str | torch.dtype) -> str:
    return dtype_name(value) if isinstance(value, torch.dtype) else value


# -- the wrappers, shared by every counter --------------------------------------------------
_ACTIVE: list[WireCounter] = []
#: (module, name) -> (the function found there, the wrapper put in its place)
_INSTALLED: dict[tuple[ModuleType, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}
_STATE = threading.Lock()
_LOCAL = threading.local()


def _start(counter: WireCounter) -> None:
    with _STATE:
        if not _ACTIVE:
            _install()
        _ACTIVE.append(counter)


def _stop(counter: WireCounter) -> None:
    with _STATE:
        if counter in _ACTIVE:
            _ACTIVE.remove(counter)
        if not _ACTIVE:
            _uninstall()


def _install() -> None:
    for name, (op, counted) in COUNTED.items():
        wrappers: dict[int, Callable[..., Any]] = {}  # one wrapper per function found
        for module in (c10d, dist):
            found = getattr(module, name, None)
            if found is None:
                continue
            if id(found) not in wrappers:
                wrappers[id(found)] = _wrap(found, op, name, counted)
            _INSTALLED[module, name] = (found, wrappers[id(found)])
            setattr(module, name, wrappers[id(found)])


def _uninstall() -> None:
    for (module, name), (found, wrapper) in _INSTALLED.items():
        if getattr(module, name, None) is wrapper:
            setattr(module, name, found)
        # else another wrapper went on top of this one: it stays, and calls through
    _INSTALLED.clear()


def _depth() -> int:
    depth: int = getattr(_LOCAL, "depth", 0)
    return depth


def _wrap(original: Callable[..., Any], op: str, form: str, counted: str) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def counting(*args: Any, **kwargs: Any) -> Any:
        active = list(_ACTIVE)
        if not active or _depth() > 0 or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch reports the bad call itself
        tensors = _tensors(bound.arguments.get(counted))
        group = bound.arguments.get("group")
        for counter in active:
            counter._record(op, form, tensors, group)
        _LOCAL.depth = _depth() + 1
        try:
            return original(*args, **kwargs)
        finally:
            _LOCAL.depth -= 1

    return counting


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an argument: a tensor, a list of them, or a list of lists."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    for item in value or []:
        found.extend(_tensors(item) if isinstance(item, (list, tuple)) else [item])
    return [t for t in found if isinstance(t, torch.Tensor)]


def _group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` (None: the world); empty when torch does not know it."""
    if not dist.is_initialized():
        return ()
    if group is None or group is c10d.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError, KeyError, AttributeError):
        return ()
