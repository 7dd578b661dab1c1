"""What ``"auto"`` measures of the model on the device: :func:`profile_model`.

On one batch (``example_inputs``: one rank's share of the global batch under data
parallelism), every rank at once (each run started together and counted as long as
the slowest rank took, as a step's compute is, so each rank is timed at the share of a
shared device it gets in a training loop):

- the forward, and the forward + backward, of the whole model: ``runs`` at a time until
  every rank knows its median to within 5% (or a cap), the spread (quartiles over the
  median) kept for the predictions' intervals; where the host's ranks outnumber its
  cores the profile says so (each rank measured its share of them, as in a step);
- each block's forward + backward on a microbatch, and the rest's (embeddings, head,
  loss), through the pipeline cut's own timing
  (:func:`lamina.strategies.pp.cut.measure_costs`), where the model has a chain of
  blocks;
- AdamW's step, on copies of the largest parameters (up to 4M elements), scaled;
- the bytes autograd saves for the backward (the activations), counted as they are saved;
- the attention calls and the outputs cut on the sequence
  (:func:`lamina.auto.attention.attention_profile`), which price context parallelism;
- the Mixture-of-Experts layers (:func:`lamina.auto.experts.expert_profile`): their
  token exchanges and expert weights, which price expert parallelism.

A candidate whose ranks each take another share of the global batch than the measured
one is predicted from the profile scaled to that share (:meth:`ModelProfile.at_rows`).

Times are the mean over the ranks, sizes the largest, so every rank predicts from the
same figures and chooses the same candidate.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from lamina.auto.attention import AttentionProfile, attention_profile
from lamina.auto.experts import ExpertProfile, expert_profile
from lamina.errors import ConfigError
from lamina.graph.state import preserved
from lamina.strategies.pp.chain import BlockChain, find_chain
from lamina.strategies.pp.cut import BlockCosts, RanksTogether, backward_of, measure_costs

#: Timed runs of each measurement (after a warm-up), of which the median counts.
PROFILE_RUNS = 5
#: How well each whole-model timing's median is known before timing stops: the
#: half-width of its 95% interval over it (the worst rank's).
MEDIAN_WITHIN = 0.05
#: Seconds one timing may take before it stops unsettled.
SETTLE_CAP_S = 6.0
#: Runs one timing may take before it stops unsettled.
SETTLE_MAX_SAMPLES = 40
#: Elements of the flat tensor AdamW's step is timed on (at most the model's).
OPTIMIZER_TIMED_NUMEL = 1 << 22
#: Tensors, and elements of each, AdamW's step is timed on, plain and as DTensors, for
#: what the DTensor dispatch adds per parameter tensor.
DISPATCH_TIMED_TENSORS = 16
DISPATCH_NUMEL = 8


@dataclass(frozen=True)
class ChainProfile:
    """The model's chain of blocks, timed on one microbatch."""

    chain: BlockChain = field(compare=False, repr=False)
    #: Rows of the microbatch the blocks were timed on.
    microbatch: int
    costs: BlockCosts
    #: Parameter bytes of each block, of the modules before the first and after the last.
    block_bytes: tuple[int, ...]
    prefix_bytes: int
    suffix_bytes: int
    #: Bytes of the activation entering a block, per row of the batch.
    crossing_bytes_per_row: float

    @property
    def blocks(self) -> int:
        """Blocks in the chain."""
        return len(self.block_bytes)


@dataclass(frozen=True)
class ModelProfile:
    """The measured figures the predictions are made from (see the module)."""

    #: Rows of ``example_inputs`` (a share of a row after :meth:`at_rows`).
    batch: float
    parameters: int
    parameter_bytes: int
    #: Bytes of the parameters the model uses in two places (a tied embedding and head).
    tied_bytes: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    activation_bytes: int
    chain: ChainProfile | None
    #: Why there is no chain (the model cannot be pipelined), when there is none.
    no_chain: str = ""
    #: What AdamW's step costs more on DTensor parameters (as the sharded strategies hold
    #: them): each op dispatched through DTensor, for every parameter tensor.
    optimizer_dispatch_s: float = 0.0
    #: The attention calls (None: the forward makes none).
    attention: AttentionProfile | None = None
    #: The Mixture-of-Experts layers (None: the model has none).
    experts: ExpertProfile | None = None
    #: The forward + backward's lower and upper quartile over its median (the ranks'
    #: mean): the spread a prediction's interval is priced from.
    spread: tuple[float, float] = (1.0, 1.0)
    #: How the host's ranks share its cores (``"4 ranks share 2 cores"``; ``""``: each
    #: rank has a core or more). Every rank times at once, so each measured its share.
    shared_cores: str = ""

    def at_rows(self, rows: float) -> ModelProfile:
        """The profile of one rank's share of ``rows`` rows (a fraction of a row when a
        sequence is split): the forward, backward and activations scaled in proportion
        (the blocks' costs keep the microbatch they were timed on)."""
        if rows == self.batch:
            return self
        scale = rows / self.batch
        return replace(
            self,
            batch=rows,
            forward_s=self.forward_s * scale,
            backward_s=self.backward_s * scale,
            activation_bytes=int(self.activation_bytes * scale),
        )

    def to_json(self) -> dict[str, Any]:
        """Plain data (seconds, bytes)."""
        chain = self.chain
        return {
            "batch": self.batch,
            "parameters": self.parameters,
            "parameter_bytes": self.parameter_bytes,
            "tied_bytes": self.tied_bytes,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
            "optimizer_dispatch_s": self.optimizer_dispatch_s,
            "activation_bytes": self.activation_bytes,
            "chain": None
            if chain is None
            else {
                "blocks": chain.blocks,
                "microbatch": chain.microbatch,
                "block_s": list(chain.costs.blocks),
                "rest_s": chain.costs.rest,
                "crossing_bytes_per_row": chain.crossing_bytes_per_row,
            },
            "no_chain": self.no_chain,
            "attention": None if self.attention is None else self.attention.to_json(),
            "experts": None if self.experts is None else self.experts.to_json(),
            "spread": list(self.spread),
            "shared_cores": self.shared_cores,
        }


def batch_rows(inputs: Sequence[Any]) -> int:
    """Rows (dim 0) of the first tensor of ``inputs``; ConfigError when there is none."""
    first = next((t for t in pytree.tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ConfigError(
            "strategy 'auto' times the model on example_inputs: pass a batch tensor (rows on "
            "dim 0) as example_inputs=(batch,)"
        )
    return int(first.shape[0])


def rows_of(inputs: tuple[Any, ...], rows: int, batch: int) -> tuple[Any, ...]:
    """``inputs`` with every tensor of ``batch`` rows cut to its first ``rows``, or
    repeated up to ``rows`` when that is more."""

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        if rows <= batch:
            return t[:rows]
        reps = -(-rows // batch)
        return torch.cat([t] * reps)[:rows]

    out: tuple[Any, ...] = pytree.tree_map(cut, inputs)
    return out


def profile_model(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    microbatch: int | None = None,
    runs: int = PROFILE_RUNS,
    device: torch.device | None = None,
    synchronize: Callable[[], None] = lambda: None,
    between: Callable[[], None] = lambda: None,
    dtensor_mesh: Any = None,
) -> ModelProfile:
    """Measure ``model`` on ``inputs`` (collective over every rank when torch.distributed
    runs; see the module); blocks are timed on ``microbatch`` rows (default: half). The
    whole model is timed twice, before and after ``between`` (what else is measured,
    taking seconds), and the median of both sets of runs counts. With ``dtensor_mesh`` (a
    torch DeviceMesh) AdamW is also timed on DTensor copies, for the sharded strategies."""
    kwargs = kwargs or {}
    batch = batch_rows(inputs)
    distributed = dist.is_initialized() and dist.get_world_size() > 1

    def together() -> None:
        synchronize()
        if distributed:
            dist.barrier()

    ranks = RanksTogether(device)

    def samples(fn: Callable[[], None], settle: bool = False) -> list[float]:
        # every run starts together and counts as long as its slowest rank took, as a
        # step's compute does (its collectives wait for the last rank): timed back to
        # back instead, ranks sharing cores drift into turns, each run then takes a
        # whole core's speed and the median comes out at half what a step meets
        together()
        fn()
        times: list[float] = []
        began = time.perf_counter()
        while True:
            batch_times = []
            for _ in range(runs):
                together()
                start = time.perf_counter()
                fn()
                synchronize()
                batch_times.append(time.perf_counter() - start)
            times += ranks.slowest_each(batch_times)
            if not settle or _settled(times, time.perf_counter() - began, device, distributed):
                return times

    def timed(fn: Callable[[], None]) -> float:
        return statistics.median(samples(fn))

    unique = {id(p): p for p in model.parameters()}
    parameters = sum(p.numel() for p in unique.values())
    parameter_bytes = sum(p.numel() * p.element_size() for p in unique.values())

    def forward() -> None:
        _forget(model(*inputs, **kwargs))

    def whole() -> None:
        backward_of(model(*inputs, **kwargs))

    with preserved(model):
        forwards, wholes = samples(forward, True), samples(whole, True)
        activation_bytes = _saved_bytes(model, lambda: model(*inputs, **kwargs))
        attention = attention_profile(model, inputs, kwargs, batch)
        experts = expert_profile(model, inputs, kwargs, batch)
        model.zero_grad(set_to_none=True)
    between()  # a shared machine's slow spells last seconds: time again after it
    with preserved(model):
        forwards += samples(forward, True)
        wholes += samples(whole, True)
        model.zero_grad(set_to_none=True)
    forward_s, whole_s = statistics.median(forwards), statistics.median(wholes)
    low, high = _quartiles(wholes)
    rows = microbatch or max(1, batch // 2)
    small = rows_of(inputs, rows, batch)
    together()
    chain_profile, no_chain = _chain_profile(model, small, kwargs, rows, runs, device)
    params: list[torch.Tensor] = list(unique.values())
    optimizer_s = _optimizer_seconds(params, timed)
    dispatch_s = 0.0
    if dtensor_mesh is not None:
        dispatch_s = _dispatch_seconds(params, timed, dtensor_mesh)
    figures = [forward_s, whole_s, optimizer_s, float(activation_bytes), dispatch_s, low, high]
    if chain_profile is not None:
        figures += [*chain_profile.costs.blocks, chain_profile.costs.rest]
    # every rank predicts from the same numbers: the ranks' mean time, the largest size
    slowest = _across_ranks(figures, device, distributed)
    forward_s, whole_s, optimizer_s = slowest[:3]
    activation_bytes = int(slowest[3])
    dispatch_s = slowest[4]
    spread = (slowest[5] / whole_s, slowest[6] / whole_s) if whole_s > 0 else (1.0, 1.0)
    if chain_profile is not None:
        costs = BlockCosts(tuple(slowest[7:-1]), slowest[-1])
        chain_profile = ChainProfile(
            chain_profile.chain,
            chain_profile.microbatch,
            costs,
            chain_profile.block_bytes,
            chain_profile.prefix_bytes,
            chain_profile.suffix_bytes,
            chain_profile.crossing_bytes_per_row,
        )
    return ModelProfile(
        batch=batch,
        parameters=parameters,
        parameter_bytes=parameter_bytes,
        tied_bytes=_tied_bytes(model),
        forward_s=forward_s,
        backward_s=max(0.0, whole_s - forward_s),
        optimizer_s=optimizer_s,
        activation_bytes=activation_bytes,
        chain=chain_profile,
        no_chain=no_chain,
        optimizer_dispatch_s=dispatch_s,
        attention=attention,
        experts=experts,
        spread=spread,
        shared_cores=shared_cores(),
    )


def _settled(
    times: list[float], elapsed: float, device: torch.device | None, distributed: bool
) -> bool:
    """Whether every rank knows its median to within :data:`MEDIAN_WITHIN` (the
    half-width of the median's 95% interval, ``1.58 IQR / sqrt(n)``, over the median),
    or has timed for :data:`SETTLE_CAP_S`, or :data:`SETTLE_MAX_SAMPLES` runs: the ranks
    agree (the worst rank decides, on each figure: a rank's count of runs too), so they
    keep timing together."""
    low, high = _quartiles(times)
    median = statistics.median(times)
    width = 1.58 * (high - low) / len(times) ** 0.5
    worst = [width / median if median > 0 else 0.0, elapsed, float(len(times))]
    if distributed:
        tensor = torch.tensor(worst, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        worst = tensor.tolist()
    return worst[0] <= MEDIAN_WITHIN or worst[1] >= SETTLE_CAP_S or worst[2] >= SETTLE_MAX_SAMPLES


def _quartiles(times: list[float]) -> tuple[float, float]:
    """The lower and upper quartile of ``times`` (the median twice for one sample)."""
    if len(times) < 2:
        return times[0], times[0]
    q = statistics.quantiles(times, n=4)
    return q[0], q[2]


def shared_cores() -> str:
    """``"4 ranks share 2 cores"`` when this host's ranks outnumber its cores (each
    rank's timing is then its share of a core), else ``""``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if local > cores:
        return f"{local} ranks share {cores} cores"
    return ""


def _chain_profile(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    rows: int,
    runs: int,
    device: torch.device | None = None,
) -> tuple[ChainProfile | None, str]:
    def run() -> Any:
        return model(*inputs, **kwargs)

    try:
        with preserved(model), torch.no_grad():
            chain = find_chain(model, run)
    except ConfigError as exc:
        return None, str(exc).removeprefix("strategy 'pp': ")
    costs = measure_costs(model, chain, run, runs, RanksTogether(device))
    block_bytes = tuple(_module_bytes(model.get_submodule(b)) for b in chain.blocks)
    prefix = sum(_module_bytes(model.get_submodule(m)) for m in chain.prefix)
    suffix = sum(_module_bytes(model.get_submodule(m)) for m in chain.suffix)
    shape = chain.entry_shapes[0] if chain.entry_shapes else (rows,)
    numel = 1
    for size in shape:
        numel *= size
    item = torch.empty((), dtype=chain.entry_dtype).element_size()
    crossing = numel * item / max(1, rows)
    return ChainProfile(chain, rows, costs, block_bytes, prefix, suffix, crossing), ""


def _module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _tied_bytes(model: nn.Module) -> int:
    """Bytes of parameters registered under two or more names."""
    seen: dict[int, int] = {}
    tied: dict[int, int] = {}
    for _name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied[id(p)] = p.numel() * p.element_size()
        seen[id(p)] = 1
    return sum(tied.values())


def _forget(out: Any) -> None:
    del out


def _saved_bytes(model: nn.Module, run: Callable[[], Any]) -> int:
    """Bytes of the tensors autograd saves for the backward in one forward (each
    storage once; parameters are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> int:
        # keeps the size only: holding ``t`` would tie a node's saved output to the node
        # (a cycle keeping the graph, and the parameters' gradient accumulators, alive)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            storages[ptr] = storage.nbytes()
        return ptr

    def unpack(_ptr: int) -> torch.Tensor:
        raise RuntimeError("the activation-counting forward has no backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = run()
    del out
    return sum(storages.values())


def _sample(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The largest of ``params`` up to :data:`OPTIMIZER_TIMED_NUMEL` elements."""
    sample: list[torch.Tensor] = []
    numel = 0
    for p in sorted(params, key=lambda t: -t.numel()):
        if sample and numel + p.numel() > OPTIMIZER_TIMED_NUMEL:
            continue
        sample.append(p)
        numel += p.numel()
    return sample


def _optimizer_seconds(
    params: list[torch.Tensor], timed: Callable[[Callable[[], None]], float]
) -> float:
    """Seconds of an AdamW step over ``params``: timed on copies of the largest of them
    up to :data:`OPTIMIZER_TIMED_NUMEL` elements (their own shapes: the step's speed
    depends on them), scaled to all."""
    sample = _sample(params)
    if not sample:
        return 0.0
    seconds = _adamw_seconds(sample, timed)
    numel = sum(p.numel() for p in sample)
    total = sum(p.numel() for p in params)
    return seconds * total / numel


def _dispatch_seconds(
    params: list[torch.Tensor], timed: Callable[[Callable[[], None]], float], dtensor_mesh: Any
) -> float:
    """What AdamW's step costs more where ``params`` are DTensors on ``dtensor_mesh`` (as
    a sharded strategy holds them): timed on :data:`DISPATCH_TIMED_TENSORS` tensors of a
    few elements, plain and as DTensors, so that the difference is the dispatch alone
    (on the parameters' own sizes, run-to-run noise in their arithmetic swamps it), per
    tensor, times the count of ``params``."""
    if not params:
        return 0.0
    device = params[0].device
    tiny = [torch.zeros(DISPATCH_NUMEL, device=device) for _ in range(DISPATCH_TIMED_TENSORS)]
    plain = _adamw_seconds(tiny, timed)
    dtensors = _adamw_seconds(tiny, timed, dtensor_mesh)
    return max(0.0, dtensors - plain) / len(tiny) * len(params)


def _adamw_seconds(
    tensors: list[torch.Tensor],
    timed: Callable[[Callable[[], None]], float],
    dtensor_mesh: Any = None,
) -> float:
    """Seconds of an AdamW step over copies of ``tensors`` (float32); with
    ``dtensor_mesh``, DTensors replicated on it."""
    copies = []
    for p in tensors:
        copy = torch.zeros_like(p, dtype=torch.float32)
        if dtensor_mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            placements = [Replicate()] * dtensor_mesh.ndim
            copy = DTensor.from_local(copy, dtensor_mesh, placements, run_check=False)
        leaf = nn.Parameter(copy)
        leaf.grad = torch.full_like(leaf, 1e-3)
        copies.append(leaf)
    optimizer = torch.optim.AdamW(copies, lr=1e-4)
    return timed(optimizer.step)


def _across_ranks(
    values: list[float], device: torch.device | None, distributed: bool
) -> list[float]:
    """``values`` (times, and at index 3 a byte count) made the same on every rank: each
    time the mean over the ranks (on a shared device one rank's share swings; the step
    waits for each in turn), the byte count the largest."""
    if not distributed:
        return values
    world = dist.get_world_size()
    times = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(times)
    largest = torch.tensor([values[3]], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    out = [float(v) / world for v in times.tolist()]
    out[3] = float(largest.item())
    return out


__all__ = [
    "OPTIMIZER_TIMED_NUMEL",
    "PROFILE_RUNS",
    "ChainProfile",
    "ModelProfile",
    "backward_of",
    "batch_rows",
    "profile_model",
    "rows_of",
]
