"""Where the stages are cut: each block's forward + backward timed on the device, then
the chain split into contiguous stages that balance it (:func:`cut_stages`).

Every block is run a few times on the activation and side inputs it gets in one
recorded forward (one microbatch); the median forward + backward is its cost, and blocks
alike (class, parameter shapes, input shape) all cost the median of theirs. What runs
outside the blocks (the prefix and suffix: embeddings, final norm, head, the loss) is
timed as the whole model with every block handing its input on, and charged to the last
stage, where the head and the loss run. The split minimizes the slowest stage, ties
broken by the smaller largest activation crossing a cut, then by the earlier cut. Where
a rank holds several stages (interleaved and V schedules), the split minimizes the step
those stage times predict, ``microbatches x busiest rank + (ranks - 1) x slowest
stage``, instead: each rank runs all its stages per microbatch. ``split_points=`` (the
blocks that begin stages 1, 2, ...) overrides it. Every rank starts each timed run at
once (a barrier first), as every rank computes at once in a step.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from lamina.errors import ConfigError
from lamina.graph.state import preserved
from lamina.strategies.pp.chain import BlockChain
from lamina.strategies.pp.stages import StageSpan

#: Timed runs per block at least (after one warm-up run; the default of
#: ``PipelineOptions.timing_runs``).
TIMED_RUNS = 5
#: Seconds each block's runs span at least, per run asked for (5 runs: 50 ms): their
#: mean counts, over a span several of the scheduler's slices long. Where ranks share
#: cores, a slice (milliseconds) stops some runs and not others, so the median of a few
#: short runs is a whole core's speed, not the share a step gets (measured: half the
#: step's time for 4 ranks on 2 cores).
TIMED_SPAN_PER_RUN_S = 0.01
#: The most splits a cut for ranks holding several stages prices one by one (24 blocks
#: into 4 stages: 1,771; beyond, each stage is balanced alone).
MAX_SPLITS_TRIED = 50_000


class TimedTogether(Protocol):
    """How the ranks time a block at once (each call collective over them)."""

    def largest(self, count: int) -> int:
        """The largest of the ranks' run counts (the ranks leave it together)."""
        ...

    def slowest(self, seconds: float) -> float:
        """The longest of the ranks' times."""
        ...


class _Alone:
    """One process timing: its own count and time."""

    def largest(self, count: int) -> int:
        return count

    def slowest(self, seconds: float) -> float:
        return seconds


#: The timing of a process that times alone.
ALONE: TimedTogether = _Alone()


class RanksTogether:
    """Every rank of the job timing a block at once (a :class:`TimedTogether`): one
    all-reduce each, so the ranks also leave it together; every rank gets the same
    figures, so every rank cuts the same stages (one process: alone)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1

    def largest(self, count: int) -> int:
        """The largest count over the ranks."""
        return int(self._largest_each([float(count)])[0])

    def slowest(self, seconds: float) -> float:
        """The longest time over the ranks."""
        return self._largest_each([seconds])[0]

    def slowest_each(self, times: list[float]) -> list[float]:
        """Each of ``times`` (one per run, the runs started together) as the slowest
        rank took it."""
        return self._largest_each(times)

    def _largest_each(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return values
        box = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return [float(v) for v in box.tolist()]


@dataclass(frozen=True)
class BlockCosts:
    """Measured seconds of each block's forward + backward, and of the rest."""

    blocks: tuple[float, ...]
    rest: float


@dataclass(frozen=True)
class StageCut:
    """The stages: their spans and predicted seconds per microbatch."""

    spans: tuple[StageSpan, ...]
    seconds: tuple[float, ...]
    #: Bytes of one microbatch's activation crossing each cut (stage i -> i + 1).
    crossing_bytes: tuple[int, ...]
    source: str  # "measured" or "split_points"


def measure_costs(
    model: nn.Module,
    chain: BlockChain,
    run: Callable[[], Any],
    runs: int = TIMED_RUNS,
    ranks: TimedTogether | None = None,
) -> BlockCosts:
    """Each block's and the rest's forward + backward seconds: at least ``runs`` back to
    back, as many as span ``runs`` x :data:`TIMED_SPAN_PER_RUN_S` by the warm-up run's
    time, their time over their count. Across ranks timing at once, ``ranks`` (collective)
    starts each block's runs together, gives every rank the same count (a block may
    issue collectives of its own) and counts the slowest rank's time, so that every rank
    times the same work at the same time, as in a step where every rank computes, and the
    cost is what all of them take: on devices the ranks share (CPU cores), the share of
    the device each gets in a step."""
    inputs = _block_inputs(model, chain, run)
    blocks = []
    kinds = []
    with preserved(model):
        for name, (args, kwargs) in zip(chain.blocks, inputs, strict=True):
            block = model.get_submodule(name)
            timed = partial(_fwd_bwd, block, args, kwargs)
            blocks.append(_mean_seconds(timed, runs, ranks or ALONE))
            kinds.append(_kind(block, args))
        with _blocks_skipped(model, chain):
            rest = _mean_seconds(lambda: backward_of(run()), runs, ranks or ALONE)
        model.zero_grad(set_to_none=True)
    return BlockCosts(_alike_equal(blocks, kinds), rest)


@contextmanager
def _blocks_skipped(model: nn.Module, chain: BlockChain) -> Iterator[None]:
    """The model with every block handing its input on unchanged (as a stage skips the
    blocks other ranks run): a forward and backward of it times the rest directly."""
    blocks = [model.get_submodule(name) for name in chain.blocks]

    def skip(x: Any, *_args: Any, **_kwargs: Any) -> Any:
        return x

    for block in blocks:
        block.forward = skip  # type: ignore[method-assign]
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def _kind(block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What makes two blocks compute the same: their class, parameter shapes and input
    shape."""
    shapes = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
    first = tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else None
    return (type(block).__qualname__, shapes, first)


def _alike_equal(seconds: Sequence[float], kinds: Sequence[tuple[Any, ...]]) -> tuple[float, ...]:
    """Each block's time as the median of the blocks of its kind: identical blocks cost
    the same, and what sets their timings apart is the machine's noise (which would
    otherwise decide a cut between equal splits)."""
    by_kind: dict[tuple[Any, ...], list[float]] = {}
    for value, kind in zip(seconds, kinds, strict=True):
        by_kind.setdefault(kind, []).append(value)
    return tuple(statistics.median(by_kind[kind]) for kind in kinds)


def cut_stages(
    chain: BlockChain,
    count: int,
    costs: BlockCosts | None,
    split_points: Sequence[str] | None = None,
    holders: Sequence[int] | None = None,
    microbatches: int = 1,
) -> StageCut:
    """``count`` stages of ``chain``: from ``split_points`` when given, else balancing
    ``costs`` (see the module); ``holders``: the pipeline rank of each stage, when a rank
    holds several (interleaved and V schedules balance the ranks' sums, over
    ``microbatches`` per step)."""
    n = len(chain.blocks)
    if count > n:
        raise ConfigError(
            f"strategy 'pp': {count} stages need at least {count} blocks but "
            f"{chain.container} has {n}; use fewer stages (or virtual stages)"
        )
    block_costs = costs.blocks if costs is not None else tuple(1.0 for _ in range(n))
    rest = costs.rest if costs is not None else 0.0
    if split_points is not None:
        starts = _starts_from(chain, list(split_points), count)
        source = "split_points"
    else:
        starts = _balanced_starts(block_costs, rest, count, chain)
        if holders is not None and len(set(holders)) < count:
            shared = _rank_balanced_starts(block_costs, rest, list(holders), chain, microbatches)
            starts = shared or starts
        source = "measured"
    bounds = [*starts, n]
    spans = tuple(StageSpan(i, count, bounds[i], bounds[i + 1]) for i in range(count))
    seconds = tuple(
        sum(block_costs[s.start : s.stop]) + (rest if s.is_last else 0.0) for s in spans
    )
    crossing = tuple(_bytes(chain, s.stop) for s in spans[:-1])
    return StageCut(spans, seconds, crossing, source)


def _starts_from(chain: BlockChain, points: list[str], count: int) -> list[int]:
    index = {name: i for i, name in enumerate(chain.blocks)}
    unknown = [p for p in points if p not in index]
    if unknown:
        raise ConfigError(
            f"strategy 'pp': split point {unknown[0]!r} is not a block of {chain.container} "
            f"(blocks {chain.blocks[0]} .. {chain.blocks[-1]}); name the blocks that begin "
            "stages 1, 2, ..."
        )
    starts = [0, *sorted(index[p] for p in points)]
    if len(starts) != count or len(set(starts)) != count:
        raise ConfigError(
            f"strategy 'pp': split_points {points} make {len(set(starts))} stages but the "
            f"schedule runs {count}; give {count - 1} distinct blocks after the first"
        )
    return starts


def _balanced_starts(
    costs: Sequence[float], rest: float, count: int, chain: BlockChain
) -> list[int]:
    """Start block of each stage: the contiguous split whose slowest stage is fastest."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> float:  # blocks [i, j)
        return prefix[j] - prefix[i] + (rest if j == n else 0.0)

    # best[k][j]: (slowest stage, largest crossing, starts) splitting blocks [0, j) in k
    Key = tuple[float, int, tuple[int, ...]]
    best: list[dict[int, Key]] = [{0: (0.0, 0, ())}]
    for k in range(1, count + 1):
        row: dict[int, Key] = {}
        for j in range(k, n - (count - k) + 1):
            options = []
            for i, (slowest, crossing, starts) in best[k - 1].items():
                if i >= j:
                    continue
                cross = max(crossing, _bytes(chain, j) if j < n else 0)
                options.append((max(slowest, cost(i, j)), cross, (*starts, i)))
            if options:
                row[j] = min(options, key=lambda o: (round(o[0], 12), o[1], o[2]))
        best.append(row)
    return list(best[count][n][2])


def _rank_balanced_starts(
    costs: Sequence[float], rest: float, holders: list[int], chain: BlockChain, microbatches: int
) -> list[int] | None:
    """Start block of each stage where ranks hold several stages: the split whose step
    ``microbatches x busiest rank + (ranks - 1) x slowest stage`` is shortest, ties
    broken by the largest crossing, then the earlier cut. In the steady part of the
    schedule each rank runs every one of its stages per microbatch, so its sum sets the
    pace (a V schedule puts the first and the last stage, the prefix and the head, on
    one rank); filling and draining the pipeline takes a stage per rank. None when the
    splits are too many to try (every one is priced)."""
    n, count = len(costs), len(holders)
    if math.comb(n - 1, count - 1) > MAX_SPLITS_TRIED:
        return None
    prefix = torch.tensor([0.0, *itertools.accumulate(costs)], dtype=torch.float64)
    splits = list(itertools.combinations(range(1, n), count - 1))
    inner = torch.tensor(splits, dtype=torch.long).reshape(len(splits), count - 1)
    first = torch.zeros(len(splits), 1, dtype=torch.long)
    bounds = torch.cat([first, inner, torch.full_like(first, n)], dim=1)
    stage = prefix[bounds[:, 1:]] - prefix[bounds[:, :-1]]
    stage[:, -1] += rest
    ranks = torch.zeros(len(splits), max(holders) + 1, dtype=torch.float64)
    for index, rank in enumerate(holders):
        ranks[:, rank] += stage[:, index]
    crossing = torch.tensor([_bytes(chain, j) for j in range(n)], dtype=torch.float64)
    step = microbatches * ranks.amax(dim=1) + (ranks.shape[1] - 1) * stage.amax(dim=1)
    keys = zip(
        step.round(decimals=12).tolist(), crossing[inner].amax(dim=1).tolist(), splits, strict=True
    )
    return [0, *min(keys)[2]]


def _bytes(chain: BlockChain, index: int) -> int:
    """Bytes of the activation entering block ``index`` (one microbatch)."""
    shape = chain.entry_shapes[index]
    numel = 1
    for size in shape:
        numel *= size
    return numel * torch.empty((), dtype=chain.entry_dtype).element_size()


def _block_inputs(
    model: nn.Module, chain: BlockChain, run: Callable[[], Any]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each block's (args, kwargs) in one forward, detached."""
    seen: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    handles = []
    for name in chain.blocks:

        def hook(_m: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            seen[name] = _fresh((args, kwargs))

        block = model.get_submodule(name)
        # before any other pre-hook (tensor parallelism's slicing of the first block's
        # input): running the block again applies those hooks once
        handles.append(block.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
    try:
        with preserved(model), torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return [seen[name] for name in chain.blocks]


def _fresh(value: Any) -> Any:
    """``value`` with tensors detached and stateful objects (a Hugging Face key/value
    cache, which each call appends to) copied as they are now."""

    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach()
        if t is None or isinstance(t, (bool, int, float, str, torch.dtype, torch.device)):
            return t
        return copy.deepcopy(t)

    return pytree.tree_map(leaf, value)


def _fwd_bwd(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    args, kwargs = _fresh((args, kwargs))
    first = args[0].clone().requires_grad_(True)
    backward_of(block(first, *args[1:], **kwargs))


def backward_of(out: Any) -> None:
    """The backward of a forward's output: its tensors' sum (a Hugging Face output's
    logits)."""
    tensors = [
        t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if hasattr(out, "logits"):
        tensors = [out.logits]
    if tensors:
        sum(t.float().sum() for t in tensors).backward()  # type: ignore[union-attr]


def _mean_seconds(fn: Callable[[], None], runs: int, ranks: TimedTogether) -> float:
    # one start together, then back to back, the slowest rank's time: each rank keeps
    # computing through its runs, as in a step, and where ranks share cores and take
    # turns, the last to finish took the time all of them needed (a barrier before each
    # run, or the median of short runs, would time a rank while others wait)
    started = time.perf_counter()
    fn()  # warm-up
    warm = max(time.perf_counter() - started, 1e-6)
    count = ranks.largest(max(runs, math.ceil(runs * TIMED_SPAN_PER_RUN_S / warm)))
    started = time.perf_counter()
    for _ in range(count):
        fn()
    return ranks.slowest(time.perf_counter() - started) / count
