"""Each attention call's algorithm, priced from the cp group's links and a timed block:
:func:`choose_algorithms`.

For a call of ``B`` sequences, ``H`` query and ``Hkv`` key/value heads of dim ``D``,
``S`` local tokens on ``n`` ranks, one rank's keys and values are ``kv = 2 B Hkv S D``
elements, and a message costs ``alpha + bytes * beta`` on the group's slowest link
(:class:`~lamina.comm.cost.LinkCost`):

- ``all_gather``: a ring all-gather forward, and backward the same all-gather again
  and a ring reduce-scatter of the keys' and values' gradients, ``3 (n - 1)`` messages
  of ``kv``, none overlapped;
- ``pass_kv``: ``n - 1`` forward steps, each message hidden behind the attention of the
  block that arrived before (only what exceeds it is paid); backward the keys again
  (hidden behind backward's attention, twice forward's) and ``n`` messages of their
  gradients, not hidden;
- ``all_to_all``: four all-to-alls (queries, keys and values in; the output out; and
  their adjoints), each ``n - 1`` messages of ``1/n`` of a rank's share; only where ``H``
  and ``Hkv`` divide by ``n``.

A block's attention time is measured on the job (:func:`time_block`, the slowest rank's),
so every rank prices alike and picks alike; the plan shows each price.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lamina.comm.cost import LinkCost
from lamina.dtypes import dtype_from_name
from lamina.strategies.cp.blocks import _kernel, _kernel_backward
from lamina.strategies.cp.layout import SequenceLayout
from lamina.strategies.cp.masks import FULL, Block
from lamina.strategies.cp.plan_nodes import AttentionSite


def _alone() -> None:
    """No other rank to wait for."""


#: Timed runs of the local step (after one that warms up), of which the median counts.
LOCAL_STEP_RUNS = 3
#: Timed samples of an attention block (after one that warms up), and the seconds one
#: sample lasts at least (the block called over and over): long enough that every rank
#: computes while any is timed.
BLOCK_RUNS = 3
SAMPLE_S = 0.05
#: Ties go to the first: overlap first, then one collective.
PREFERENCE = ("pass_kv", "all_gather", "all_to_all")


@dataclass(frozen=True)
class Priced:
    """One call's algorithm and every algorithm's predicted exposed seconds per step
    (None: it cannot run the call, with why)."""

    site: int
    algorithm: str
    seconds: dict[str, float | None]
    why_not: dict[str, str]

    def describe(self) -> str:
        prices = ", ".join(
            f"{a} {s * 1e3:.2f} ms" if s is not None else f"{a} -" for a, s in self.seconds.items()
        )
        return f"attention {self.site}: {self.algorithm} ({prices})"


def ulysses_refusal(site: AttentionSite, n: int) -> str | None:
    """Why all-to-all over heads cannot run ``site`` on ``n`` ranks (None: it can)."""
    if site.heads % n or site.kv_heads % n:
        return (
            f"attention {site.index} has {site.heads} query and {site.kv_heads} key/value "
            f"heads, which cp={n} does not divide"
        )
    if site.head_dim != site.value_dim:
        return f"attention {site.index} has value dim {site.value_dim} != head dim {site.head_dim}"
    return None


def price(
    site: AttentionSite, layout: SequenceLayout, link: LinkCost, block_s: float
) -> dict[str, float | None]:
    """Each algorithm's predicted exposed communication seconds per step for ``site``."""
    n = layout.size
    item = dtype_from_name(site.dtype).itemsize
    local = layout.local_length
    kv = 2 * site.batch * site.kv_heads * local * site.head_dim * item
    per_pair = len(layout.local_chunks) ** 2 * (0.5 if site.causal else 1.0)
    compute = block_s * per_pair
    message = link.time(kv)
    ring = 3 * (n - 1) * message
    passed = (n - 1) * max(0.0, message - compute) + (n - 1) * max(0.0, message - 2 * compute)
    passed += n * message
    width = (site.heads + 2 * site.kv_heads) * site.batch * local * site.head_dim * item
    out = site.heads * site.batch * local * site.head_dim * item
    exchanged = 2 * (n - 1) * (link.time(width / n) + link.time(out / n))
    seconds: dict[str, float | None] = {
        "all_gather": ring,
        "pass_kv": passed,
        "all_to_all": exchanged,
    }
    if ulysses_refusal(site, n) is not None:
        seconds["all_to_all"] = None
    return seconds


def choose_algorithms(
    sites: tuple[AttentionSite, ...],
    layout: SequenceLayout,
    link: LinkCost,
    block_s: float,
    requested: str,
) -> tuple[Priced, ...]:
    """Each site's algorithm: ``requested``, or the cheapest (``auto``)."""
    chosen = []
    for site in sites:
        seconds = price(site, layout, link, block_s)
        why = {a: r for a in ("all_to_all",) if (r := ulysses_refusal(site, layout.size))}
        if requested != "auto":
            algorithm = requested
        else:
            algorithm = min(
                (a for a in PREFERENCE if seconds[a] is not None),
                key=lambda a: (seconds[a], PREFERENCE.index(a)),
            )
        chosen.append(Priced(site.index, algorithm, seconds, why))
    return tuple(chosen)


@dataclass(frozen=True)
class Timed:
    """What cp measured on the job before planning (each the slowest rank's seconds, the
    every rank at once so that ranks sharing a device are timed at the share of it they
    get in the step: one whole attention block's forward and backward at the first
    call's shape, and this rank's step on its own tokens with the step's synchronisation
    (:mod:`lamina.strategies.cp.local_step`)."""

    block_forward_s: float
    block_backward_s: float
    local_step_s: float


def _median(
    fn: Callable[[], object], runs: int, calls: int = 1, together: Callable[[], None] = _alone
) -> float:
    """Median seconds of one call of ``fn``: each sample ``calls`` calls in a row, from a
    barrier (``together``) to the next, so a sample lasts until the slowest rank is done.
    Ranks sharing cores run in turns as much as side by side; what a sample measures is
    the time all of them need, as the step does."""
    fn()  # warms up
    times = []
    for _ in range(runs):
        together()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        together()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _calls_per_sample(fn: Callable[[], object], distributed: bool, device: torch.device) -> int:
    """Calls of ``fn`` that make a sample of :data:`SAMPLE_S` (the same on every rank, so
    that all are busy while any is timed)."""
    fn()  # the first call may be cold
    start = time.perf_counter()
    fn()
    calls = max(1, min(1000, math.ceil(SAMPLE_S / max(time.perf_counter() - start, 1e-6))))
    if distributed:
        agreed = torch.tensor([calls], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        calls = int(agreed.item())
    return calls


def measure_on_job(
    site: AttentionSite,
    layout: SequenceLayout,
    device: torch.device,
    local_step: Callable[[], object],
) -> Timed:
    """:class:`Timed` on this job (collective: every rank)."""
    dtype = dtype_from_name(site.dtype)
    shape = (site.batch, site.heads, layout.chunk, site.head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device) for _ in range(3))
    block = Block(FULL)
    out, lse = _kernel(q, k, v, block, None)
    grad = torch.randn_like(out)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    together = dist.barrier if distributed else _alone

    def forward_block() -> None:
        _kernel(q, k, v, block, None)

    def backward_block() -> None:
        _kernel_backward(grad, q, k, v, out, lse, block, None)

    timed = []
    for fn in (forward_block, backward_block):
        calls = _calls_per_sample(fn, distributed, device)
        timed.append(_median(fn, BLOCK_RUNS, calls, together))
    timed.append(_median(local_step, LOCAL_STEP_RUNS, 1, together))
    measured = torch.tensor(timed, dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    forward, backward, step = (float(x) for x in measured.tolist())
    return Timed(forward, backward, step)
