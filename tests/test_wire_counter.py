"""``lamina.testing.WireCounter`` on 2 gloo ranks: every function form of
``torch.distributed`` it wraps is counted once per call (a form that forwards to another
one too), with the bytes and dtype of the tensors it was handed, from any thread, beside
the user-collective tracer in either order, and the functions are put back after."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import lamina
from lamina.testing import WireCounter, run_ranks
from lamina.testing.wire import COUNTED
from lamina.trace import recorder, user_collectives

pytestmark = [pytest.mark.portable, pytest.mark.multiprocess, pytest.mark.cross_release]

WORLD = 2
#: Forms newer torch releases add (2.9 lacks them); every other form exists everywhere.
OPTIONAL_FORMS = ("all_gather_single", "reduce_scatter_single")
#: Forms the gloo of older torch releases refuses ("does not support"): not counted there.
GLOO_MAY_LACK = ("all_to_all",)


def _p2p(rank: int, blocking: bool) -> None:
    if blocking:
        if rank == 0:
            dist.send(torch.ones(7), dst=1)
        else:
            dist.recv(torch.empty(7), src=0)
        return
    work = (
        dist.isend(torch.ones(3, dtype=torch.int32), dst=1)
        if rank == 0
        else dist.irecv(torch.empty(3, dtype=torch.int32), src=0)
    )
    assert work is not None
    work.wait()


def _cases(rank: int) -> dict[str, tuple[Callable[[], Any], str, str, int]]:
    """form -> (a call of it, the op, dtype and bytes the counter must record)."""
    half = torch.float16

    def in_thread() -> None:  # lamina's worker threads issue collectives too
        thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(5, dtype=half)))
        thread.start()
        thread.join()

    return {
        "all_reduce": (lambda: dist.all_reduce(torch.ones(10)), "all_reduce", "float32", 40),
        "broadcast": (
            lambda: dist.broadcast(torch.ones(3, dtype=torch.int64), src=0),
            "broadcast",
            "int64",
            24,
        ),
        "reduce": (lambda: dist.reduce(torch.ones(8, dtype=half), dst=0), "reduce", "float16", 16),
        "all_gather": (
            lambda: dist.all_gather([torch.empty(5) for _ in range(WORLD)], torch.ones(5)),
            "all_gather",
            "float32",
            40,
        ),
        "all_gather_into_tensor": (
            lambda: dist.all_gather_into_tensor(
                torch.empty(12, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16)
            ),
            "all_gather",
            "bfloat16",
            24,
        ),
        "all_gather_single": (
            lambda: dist.all_gather_single(torch.empty(8), torch.ones(4)),
            "all_gather",
            "float32",
            32,
        ),
        "_all_gather_base": (
            lambda: dist._all_gather_base(torch.empty(4, dtype=half), torch.ones(2, dtype=half)),
            "all_gather",
            "float16",
            8,
        ),
        "reduce_scatter": (
            lambda: dist.reduce_scatter(
                torch.empty(3, dtype=torch.float64),
                [torch.ones(3, dtype=torch.float64) for _ in range(WORLD)],
            ),
            "reduce_scatter",
            "float64",
            48,
        ),
        "reduce_scatter_tensor": (
            lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4)),
            "reduce_scatter",
            "float32",
            16,
        ),
        "reduce_scatter_single": (
            lambda: dist.reduce_scatter_single(torch.empty(3), torch.ones(6)),
            "reduce_scatter",
            "float32",
            24,
        ),
        "_reduce_scatter_base": (
            lambda: dist._reduce_scatter_base(torch.empty(1), torch.ones(2)),
            "reduce_scatter",
            "float32",
            8,
        ),
        "all_to_all": (
            lambda: dist.all_to_all(
                [torch.empty(4, dtype=torch.uint8) for _ in range(WORLD)],
                [torch.ones(4, dtype=torch.uint8) for _ in range(WORLD)],
            ),
            "all_to_all",
            "uint8",
            8,
        ),
        "all_to_all_single": (
            lambda: dist.all_to_all_single(
                torch.empty(6, dtype=torch.int8), torch.ones(6, dtype=torch.int8)
            ),
            "all_to_all",
            "int8",
            6,
        ),
        "send" if rank == 0 else "recv": (
            lambda: _p2p(rank, blocking=True),
            "send" if rank == 0 else "recv",
            "float32",
            28,
        ),
        "isend" if rank == 0 else "irecv": (
            lambda: _p2p(rank, blocking=False),
            "send" if rank == 0 else "recv",
            "int32",
            12,
        ),
        "thread": (in_thread, "all_reduce", "float16", 10),
    }


def _records(wire: WireCounter) -> list[tuple[str, str, str, int, int, int]]:
    return [(r.op, r.form, r.dtype, r.bytes, r.group_size, r.call) for r in wire.records]


def _beside_the_tracer(rank: int) -> dict[str, Any]:
    """One all_gather_into_tensor with the user-collective tracer installed after the
    counter started, and one with it installed before: each counts the call once."""
    out: dict[str, Any] = {}
    for order in ("counter first", "tracer first"):
        trace = recorder.TraceRecorder(rank, WORLD)
        if order == "tracer first":
            user_collectives.install(trace)
        with WireCounter() as wire:
            if order == "counter first":
                user_collectives.install(trace)
            dist.all_gather_into_tensor(torch.empty(4), torch.ones(2))
            if order == "counter first":
                user_collectives.uninstall()
        if order == "tracer first":
            user_collectives.uninstall()
        out[order] = {
            "wire": _records(wire),
            "traced": [(e.op, e.bytes) for e in trace.events()],
        }
    return out


def _job() -> dict[str, Any]:
    rank = lamina.init().rank
    originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}
    counted: dict[str, Any] = {}
    unsupported: list[str] = []
    expected: dict[str, tuple[str, str, int]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated forms
        for form, (call, op, dtype, nbytes) in _cases(rank).items():
            if form in OPTIONAL_FORMS and not hasattr(dist, form):
                continue  # this torch release does not have it
            with WireCounter() as wire:
                try:
                    call()
                except RuntimeError as exc:  # torch 2.9's gloo has no list all_to_all
                    if form not in GLOO_MAY_LACK or "does not support" not in str(exc):
                        raise
                    unsupported.append(form)
                    continue
            counted[form] = _records(wire)
            expected[form] = (op, dtype, nbytes)
        with WireCounter() as outer:
            dist.all_reduce(torch.ones(2))
            with WireCounter() as inner:
                dist.broadcast(torch.ones(3), src=1)
            dist.all_to_all_single(torch.empty(4), torch.ones(4), async_op=True).wait()  # type: ignore[union-attr]
        group = dist.new_group([0, 1])
        with WireCounter() as grouped:
            dist.all_reduce(torch.ones(4), group=group)
    return {
        "counted": counted,
        "unsupported": unsupported,
        "expected": expected,
        "outer": _records(outer),
        "inner": _records(inner),
        "sent": (outer.sent(op="all_reduce"), outer.sent(op="all_to_all")),
        "selected": (
            outer.bytes(op=["all_reduce", "broadcast"]),
            outer.bytes(dtype=torch.float32, op="all_to_all"),
            outer.calls(),
            outer.by_dtype(),
        ),
        "grouped": [*_records(grouped), grouped.bytes(group=[1, 0])],
        "restored": all(getattr(dist, n) is f for n, f in originals.items())
        and all(getattr(c10d, n) is f for n, f in originals.items()),
        "tracer": _beside_the_tracer(rank),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, WORLD, timeout=120)


@pytest.mark.timeout(180)
def test_every_form_is_counted_once_with_its_bytes_and_dtype(
    results: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(results):
        present = sum(hasattr(dist, form) for form in OPTIONAL_FORMS)
        skipped = len(result["unsupported"])
        assert len(result["counted"]) + skipped == 16 - len(OPTIONAL_FORMS) + present, result
        assert result["unsupported"] in ([], ["all_to_all"]), result["unsupported"]
        for form, records in result["counted"].items():
            op, dtype, nbytes = result["expected"][form]
            called = "all_reduce" if form == "thread" else form
            # one call, one record: a form forwarding to another is not counted twice
            assert records == [(op, called, dtype, nbytes, WORLD, 0)], (rank, form, records)


@pytest.mark.timeout(180)
def test_counters_nest_select_and_put_the_functions_back(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["outer"] == [
            ("all_reduce", "all_reduce", "float32", 8, WORLD, 0),
            ("broadcast", "broadcast", "float32", 12, WORLD, 1),
            ("all_to_all", "all_to_all_single", "float32", 16, WORLD, 2),
        ]
        assert result["inner"] == [("broadcast", "broadcast", "float32", 12, WORLD, 0)]
        # on 2 ranks a rank sends an all-reduce's buffer once (2(n-1)/n) and half of an
        # all-to-all's input ((n-1)/n)
        assert result["sent"] == (8.0, 8.0)
        assert result["selected"] == (20, 16, 3, {"float32": 36})
        assert result["grouped"] == [("all_reduce", "all_reduce", "float32", 16, WORLD, 0), 16]
        assert result["restored"]


@pytest.mark.timeout(180)
def test_the_user_collective_tracer_and_the_counter_each_count_a_call_once(
    results: list[dict[str, Any]],
) -> None:
    for result in results:
        for order, seen in result["tracer"].items():
            assert seen["wire"] == [
                ("all_gather", "all_gather_into_tensor", "float32", 16, WORLD, 0)
            ], order
            assert seen["traced"] == [("all_gather", 16)], order
