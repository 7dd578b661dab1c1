"""A candidate's predicted memory per rank, and its step on a declared cluster:
:func:`predict_candidate`.

On the running job ``"auto"`` prices each candidate's step from its own plan
(:mod:`lamina.auto.plans`, :mod:`lamina.auto.pricing`, :func:`lamina.simulate.step.
price_step`), which replaces the step these formulas give; they still give the memory,
whether a candidate can run the model, and the step on a declared cluster
(``lamina plan --simulate CLUSTER --auto``), whose mesh the job cannot plan on.

From the measured :class:`~lamina.auto.measure.ModelProfile` (``t_f``, ``t_b``: one
rank's forward and backward on its batch ``b``; the blocks' forward + backward on a
microbatch; AdamW's step) and the :class:`~lamina.auto.comm.CommCosts` of each group.
The global batch is the same for every candidate: ``b`` rows per rank under data
parallelism, ``b x tp`` per tensor-parallel group, ``b x pp`` per pipeline. Every
candidate does the same arithmetic per rank; they differ in what they send, what they
hide behind compute and what they wait for:

- ``dp``: the gradients in :data:`DP_BUCKETS` buckets, each all-reduced (as the codec
  sends it) once backward has produced it, one after another: the step is
  ``t_f + max(t_b, last bucket done) + t_opt``;
- ``zero3`` / ``hsdp`` (shard ``S`` ranks): each of the ``k`` units (a block each, and
  the rest) is gathered before its forward and again before its backward, one unit ahead
  of the compute, and its gradient reduce-scattered (``hsdp``: then all-reduced across
  the replicas) after it; AdamW steps ``1/S`` of the parameters, as DTensors (their
  measured dispatch cost added);
- what compute hides of the communication is the measured overlap share
  (:func:`lamina.auto.comm.measure_overlap`; 1 on a declared cluster) of what the order
  of the step allows;
- ``tp`` (``T`` ranks): the blocks' arithmetic split ``T`` ways on ``T`` times the rows,
  the block's activation collectives (:data:`TP_BLOCK_COLLECTIVES`, sequence-parallel)
  and the embedding's and head's, not hidden, each also waiting the measured skew (the
  last rank's lateness, :func:`lamina.auto.comm.measure_skew`); a sharder composed with
  it as above on ``1/T`` of the parameters;
- ``pp`` (``p`` stages, ``m`` microbatches, 1F1B): the measured cut
  (:func:`lamina.strategies.pp.cut.cut_stages`) gives the slowest stage's forward +
  backward of one microbatch, ``t_s``; the schedule takes ``(m + p - 1) t_s`` plus
  ``2 (p - 1)`` transfers of one microbatch's activation and the skew of ``2 m``
  blocking exchanges; then the stage's gradients are
  all-reduced over the replicas (or reduce-scattered over the shard, whose stage is
  gathered once before the schedule), and a tied parameter summed across the stages
  (``1/R`` of it by each of the ``R`` pipelines).

- ``cp`` (``C`` ranks per sequence, ``zero3`` over every axis): each rank computes its
  ``1/C`` of the replica's tokens (the measured step scaled to them; load-balanced causal
  attention does ``1/C`` of the work), sharded as above; each attention call's keys and
  values all-gathered forward and their gradients reduce-scattered backward (the
  all-gather algorithm: cp's own per-call choice pays at most that), the outputs cut on
  the sequence all-gathered, none of it hidden, each waiting the skew.
- ``ep`` (``E`` ranks spreading each MoE layer's experts, alone or with ``zero3`` over
  the other axes): each rank holds the dense parameters and ``1/E`` of the experts (then
  sharded as above on that share), computes its own rows (the measured step: each token
  meets as many experts as in one process); per MoE layer its tokens' assignments go to
  the experts and back, forward and backward (four all-to-alls, each priced as a ring
  reduce-scatter of those bytes: ``E - 1`` messages of ``1/E``), and the dense gradients
  are averaged over the ep axis; none of it hidden, each waiting the skew.

The global batch (``global_rows``; default the measured rows times the ranks) is split
among the data replicas; a candidate whose replicas cannot share it evenly cannot run.
Each rank is predicted on its share of it (:meth:`~lamina.auto.measure.ModelProfile.at_rows`).

Memory per rank: parameters, gradients and AdamW's two moments (16 bytes per fp32
parameter, ``1/S`` of them when sharded, ``1/T`` under tensor parallelism, one stage's
under ``pp``); plus what is gathered at once (two units; a whole stage) and the
activations autograd saved on the batch (``pp``: one microbatch's per stage for each of
the ``p`` microbatches in flight, as ``m`` times less per microbatch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lamina.auto.candidates import LOSSY_CODECS, Candidate
from lamina.auto.comm import CommCosts
from lamina.auto.measure import ModelProfile
from lamina.simulate.step import PricedCollective

#: The buckets ``dp``'s gradients are predicted in (its own sizing: about 8).
DP_BUCKETS = 8
#: Bytes per parameter of the training state: fp32 weight, gradient, AdamW's two moments.
STATE_BYTES_PER_PARAM_BYTE = 4
#: The collectives of one transformer block's activation per step under lamina's tensor
#: parallelism (sequence-parallel norms): forward, an all-gather before attention and
#: before the MLP and a reduce-scatter after each; backward, the all-gathers again and an
#: all-reduce of each input's gradient.
TP_BLOCK_COLLECTIVES: dict[str, int] = {"all_gather": 4, "reduce_scatter": 2, "all_reduce": 2}
#: Those of the embedding and the head: the embedding's all-reduce, the head's two
#: all-gathers (input, logits) and its input gradient's all-reduce.
TP_END_COLLECTIVES: dict[str, int] = {"all_gather": 2, "all_reduce": 2}


@dataclass(frozen=True)
class CandidatePrediction:
    """What :func:`predict_candidate` predicts for one candidate."""

    step_s: float
    memory_bytes: int
    #: The step's parts (seconds): compute, exposed communication, bubble, optimizer.
    parts: dict[str, float] = field(default_factory=dict)
    #: The memory's parts (bytes).
    memory_parts: dict[str, int] = field(default_factory=dict)
    #: The step's collectives as its plan issues them, priced (empty when the step was
    #: not priced from a plan).
    collectives: tuple[PricedCollective, ...] = ()
    #: The step at the low and high end of the measured spread (None: not measured).
    interval_s: tuple[float, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data."""
        return {
            "step_s": self.step_s,
            "interval_s": list(self.interval_s) if self.interval_s else None,
            "memory_bytes": self.memory_bytes,
            "parts": dict(self.parts),
            "memory_parts": dict(self.memory_parts),
            "collectives": len(self.collectives),
        }


class NotApplicable(Exception):
    """The candidate cannot run this model (the message says why)."""


def predict_candidate(
    candidate: Candidate,
    profile: ModelProfile,
    comm: CommCosts,
    global_rows: int | None = None,
) -> CandidatePrediction:
    """``candidate``'s step and memory with ``global_rows`` rows per step (default: the
    measured rows on every rank; see the module); NotApplicable when it cannot run the
    model."""
    world = candidate.world_size
    rows = global_rows if global_rows is not None else round(profile.batch * world)
    replicas = candidate.data_replicas
    if rows % replicas:
        raise NotApplicable(
            f"its {replicas} data replicas cannot share a global batch of {rows} rows"
        )
    profile = profile.at_rows(rows / world)
    if candidate.ep_degree > 1:
        return _expert_parallel(candidate, profile, comm)
    if candidate.cp_degree > 1:
        return _context_parallel(candidate, profile, comm)
    if candidate.pp_degree > 1:
        return _pipelined(candidate, profile, comm)
    if candidate.tp_degree > 1:
        return _tensor_parallel(candidate, profile, comm)
    if candidate.sharder is not None:
        return _sharded(candidate, profile, comm, 1)
    return _data_parallel(candidate, profile, comm)


def _data_parallel(c: Candidate, p: ModelProfile, comm: CommCosts) -> CandidatePrediction:
    ratio = LOSSY_CODECS.get(c.codec, 1.0) if c.codec else 1.0
    axes = c.sync_axes()
    bucket = p.parameter_bytes * ratio / DP_BUCKETS
    each = comm.seconds("all_reduce", axes, bucket)
    done = 0.0
    for i in range(DP_BUCKETS):
        ready = p.backward_s * (i + 1) / DP_BUCKETS
        done = max(done, ready) + each
    backward = _hidden(p.backward_s, max(p.backward_s, done), DP_BUCKETS * each, comm.overlap)
    step = p.forward_s + backward + p.optimizer_s
    state = p.parameter_bytes * STATE_BYTES_PER_PARAM_BYTE
    return CandidatePrediction(
        step,
        state + p.activation_bytes,
        {
            "compute": p.forward_s + p.backward_s,
            "communication": DP_BUCKETS * each,
            "exposed": backward - p.backward_s,
            "optimizer": p.optimizer_s,
        },
        {"state": state, "activations": p.activation_bytes},
    )


def _units(p: ModelProfile) -> int:
    return (p.chain.blocks if p.chain is not None else 0) + 1


def _sharded(c: Candidate, p: ModelProfile, comm: CommCosts, split: float) -> CandidatePrediction:
    """zero3 / hsdp over the sharder's axes on ``1/split`` of the parameters (``split``:
    the tensor-parallel degree), compute ``t_f``/``t_b`` plus ``extra`` not hidden."""
    sharder = c.sharder
    assert sharder is not None
    shard_axes, replica_axes = sharder.shard, sharder.replicate
    shards = c.size(shard_axes)
    units = _units(p)
    unit = p.parameter_bytes / split / units
    gather = comm.seconds("all_gather", shard_axes, unit)
    scatter = comm.seconds("reduce_scatter", shard_axes, unit)
    replica = comm.seconds("all_reduce", replica_axes, unit / shards) if replica_axes else 0.0
    forward = _hidden(
        p.forward_s,
        _prefetched([p.forward_s / units] * units, gather),
        units * gather,
        comm.overlap,
    )
    backward = _hidden(
        p.backward_s,
        _prefetched([p.backward_s / units] * units, gather, scatter + replica),
        units * (gather + scatter + replica),
        comm.overlap,
    )
    optimizer = p.optimizer_s / split / shards + p.optimizer_dispatch_s
    state = int(p.parameter_bytes * STATE_BYTES_PER_PARAM_BYTE // (split * shards))
    gathered = int(2 * unit)
    return CandidatePrediction(
        forward + backward + optimizer,
        state + gathered + p.activation_bytes,
        {
            "compute": p.forward_s + p.backward_s,
            "communication": units * (2 * gather + scatter + replica),
            "exposed": forward + backward - p.forward_s - p.backward_s,
            "optimizer": optimizer,
        },
        {"state": state, "gathered": gathered, "activations": p.activation_bytes},
    )


def _hidden(compute: float, overlapped: float, communication: float, overlap: float) -> float:
    """The phase's seconds when the device hides ``overlap`` of what it can: between
    ``overlapped`` (as much hidden as the order allows) and ``compute + communication``
    (none)."""
    return overlap * overlapped + (1.0 - overlap) * (compute + communication)


def _prefetched(compute: list[float], fetch: float, after: float = 0.0) -> float:
    """Seconds of units computed in turn, each needing its ``fetch`` (issued one unit
    ahead, one at a time) and followed by ``after`` on the same channel."""
    clock = 0.0
    fetched = fetch  # the first unit's gather, before anything
    channel = fetched  # when the communication channel is free
    pending_after = 0.0
    for i, seconds in enumerate(compute):
        start = max(clock, fetched)
        if i + 1 < len(compute):  # the next unit's gather, once the channel is free
            fetched = max(channel, start) + fetch
            channel = fetched
        clock = start + seconds
        if after:
            channel = max(channel, clock) + after
            pending_after = channel
    return max(clock, pending_after)


def _tensor_parallel(c: Candidate, p: ModelProfile, comm: CommCosts) -> CandidatePrediction:
    if p.chain is None:
        raise NotApplicable(f"tp splits the layers of blocks: {p.no_chain}")
    tp = c.use("tp")
    assert tp is not None
    degree = c.tp_degree
    activation = p.chain.crossing_bytes_per_row * p.batch * degree
    axes = tp.shard
    per_block = sum(
        count * comm.seconds(op, axes, activation) for op, count in TP_BLOCK_COLLECTIVES.items()
    )
    ends = sum(
        count * comm.seconds(op, axes, activation) for op, count in TP_END_COLLECTIVES.items()
    )
    collectives = p.chain.blocks * sum(TP_BLOCK_COLLECTIVES.values()) + sum(
        TP_END_COLLECTIVES.values()
    )
    blocking = p.chain.blocks * per_block + ends + collectives * comm.skew
    if c.sharder is not None:
        base = _sharded(c, p, comm, degree)
    else:
        state = p.parameter_bytes * STATE_BYTES_PER_PARAM_BYTE // degree
        optimizer = p.optimizer_s / degree
        base = CandidatePrediction(
            p.forward_s + p.backward_s + optimizer,
            state + p.activation_bytes,
            {"compute": p.forward_s + p.backward_s, "exposed": 0.0, "optimizer": optimizer},
            {"state": state, "activations": p.activation_bytes},
        )
    parts = dict(base.parts)
    parts["activation collectives"] = blocking
    return CandidatePrediction(
        base.step_s + blocking, base.memory_bytes, parts, dict(base.memory_parts)
    )


def _pipelined(c: Candidate, p: ModelProfile, comm: CommCosts) -> CandidatePrediction:
    from lamina.strategies.pp.cut import cut_stages

    chain = p.chain
    if chain is None:
        raise NotApplicable(f"pp cuts a chain of blocks: {p.no_chain}")
    pp = c.use("pp")
    assert pp is not None
    stages, m = c.pp_degree, c.microbatches
    if stages > chain.blocks:
        raise NotApplicable(f"{stages} stages need {stages} blocks; the model has {chain.blocks}")
    rows = round(p.batch * stages)
    if rows % m:
        raise NotApplicable(f"the pipeline's {rows} rows do not split into {m} microbatches")
    per_micro = rows // m
    scale = per_micro / chain.microbatch
    cut = cut_stages(chain.chain, stages, chain.costs)
    slowest = max(cut.seconds) * scale
    message = chain.crossing_bytes_per_row * per_micro
    transfer = comm.seconds("send", pp.shard, message)
    # each microbatch's forward and backward wait on a transfer: 2m blocking exchanges
    schedule = (m + stages - 1) * slowest + 2 * (stages - 1) * transfer + 2 * m * comm.skew
    stage_bytes = []
    for span in cut.spans:
        size = sum(chain.block_bytes[span.start : span.stop])
        size += chain.prefix_bytes if span.start == 0 else 0
        size += chain.suffix_bytes if span.is_last else 0
        stage_bytes.append(size)
    biggest = max(stage_bytes)
    sharder = c.sharder
    sync_axes = sharder.shard if sharder is not None else pp.replicate
    if sharder is not None:
        shards = c.size(sharder.shard)
        sync = comm.seconds("all_gather", sync_axes, biggest) + comm.seconds(
            "reduce_scatter", sync_axes, biggest
        )
    else:
        shards = 1
        sync = comm.seconds("all_reduce", sync_axes, biggest) if sync_axes else 0.0
    # each of the R pipelines sums 1/R of a tied parameter across the stages
    pipelines = c.world_size // stages
    tied = comm.seconds("all_reduce", pp.shard, p.tied_bytes / pipelines) if p.tied_bytes else 0.0
    share = biggest / max(1, p.parameter_bytes)
    optimizer = p.optimizer_s * share / shards
    if sharder is not None:  # its stage's parameters are DTensors
        optimizer += p.optimizer_dispatch_s * share
    step = schedule + sync + tied + optimizer
    state = biggest * STATE_BYTES_PER_PARAM_BYTE // shards
    gathered = biggest if sharder is not None else 0
    activations = int(p.activation_bytes * per_micro / p.batch)
    busy = m * slowest
    return CandidatePrediction(
        step,
        state + gathered + activations,
        {
            "compute": busy,
            "bubble": schedule - busy,
            "communication": sync + tied,
            "exposed": sync + tied,
            "optimizer": optimizer,
        },
        {"state": state, "gathered": gathered, "activations": activations},
    )


def _context_parallel(c: Candidate, p: ModelProfile, comm: CommCosts) -> CandidatePrediction:
    attention = p.attention
    if attention is None:
        raise NotApplicable(
            "cp splits attention: the forward calls no scaled_dot_product_attention"
        )
    cp = c.use("cp")
    assert cp is not None
    degree = c.cp_degree
    tokens = attention.tokens
    if tokens % (2 * degree):
        raise NotApplicable(
            f"a sequence of {tokens} tokens does not split into {2 * degree} equal chunks"
        )
    axes = cp.shard
    # one replica's rows against the rows the calls were read on
    share = p.batch * degree / attention.rows
    collectives = 2 * len(attention.calls)
    seconds = 0.0
    largest = 0.0
    for call in attention.calls:
        kv = call.kv_bytes * share
        largest = max(largest, kv)
        seconds += comm.seconds("all_gather", axes, kv) + comm.seconds("reduce_scatter", axes, kv)
    outputs = attention.output_bytes * share
    if outputs:
        seconds += comm.seconds("all_gather", axes, outputs)
        collectives += 1
    blocking = seconds + collectives * comm.skew
    base = _sharded(c, p, comm, 1)
    parts = dict(base.parts)
    parts["context collectives"] = blocking
    memory = dict(base.memory_parts)
    memory["gathered keys and values"] = int(largest)
    memory["gathered outputs"] = int(outputs)
    return CandidatePrediction(
        base.step_s + blocking, base.memory_bytes + int(largest + outputs), parts, memory
    )


def _expert_parallel(c: Candidate, p: ModelProfile, comm: CommCosts) -> CandidatePrediction:
    experts = p.experts
    if experts is None:
        raise NotApplicable("ep spreads experts: the model has no Mixture-of-Experts layer")
    ep = c.use("ep")
    assert ep is not None
    degree = c.ep_degree
    for layer in experts.layers:
        if layer.experts % degree:
            raise NotApplicable(f"{layer.experts} experts do not split over ep={degree}")
    dense = p.parameter_bytes - experts.expert_bytes
    held = dense + experts.expert_bytes / degree
    share = p.batch / experts.rows  # this rank's rows against the rows they were read on
    exchanged = [layer.exchange_bytes * share for layer in experts.layers]
    exchange = sum(4 * comm.seconds("reduce_scatter", ep.shard, n) for n in exchanged)
    collectives = 5 * len(exchanged) + 1
    if c.sharder is not None:
        base = _sharded(c, p, comm, p.parameter_bytes / held)
        dense_sync = comm.seconds("all_reduce", ep.shard, dense / c.shard_degree)
        parts, memory = dict(base.parts), dict(base.memory_parts)
        step, footprint = base.step_s, base.memory_bytes
    else:
        dense_sync = comm.seconds("all_reduce", c.sync_axes(), dense)
        optimizer = p.optimizer_s * held / p.parameter_bytes
        state = int(held * STATE_BYTES_PER_PARAM_BYTE)
        parts = {"compute": p.forward_s + p.backward_s, "optimizer": optimizer}
        memory = {"state": state, "activations": p.activation_bytes}
        step = p.forward_s + p.backward_s + optimizer
        footprint = state + p.activation_bytes
    blocking = exchange + dense_sync + collectives * comm.skew
    parts["expert exchanges"] = exchange
    parts["dense gradients over ep"] = dense_sync
    buffers = int(2 * max(exchanged, default=0.0))
    memory["exchanged tokens"] = buffers
    return CandidatePrediction(step + blocking, footprint + buffers, parts, memory)


def fits(prediction: CandidatePrediction, device_memory: int | None, margin: float) -> bool:
    """Whether the predicted memory fits ``device_memory`` less its ``margin`` share."""
    return device_memory is None or prediction.memory_bytes <= device_memory * (1 - margin)


__all__ = [
    "DP_BUCKETS",
    "STATE_BYTES_PER_PARAM_BYTE",
    "TP_BLOCK_COLLECTIVES",
    "TP_END_COLLECTIVES",
    "CandidatePrediction",
    "NotApplicable",
    "fits",
    "predict_candidate",
]
