"""A candidate's memory per rank, and whether it can run the model: :func:`predict_memory`.

A candidate's step is always priced from its own plan (:mod:`lamina.auto.plans`,
:mod:`lamina.auto.pricing`, :func:`lamina.simulate.step.price_step`): on the running
job, planned on its mesh; on a declared cluster, planned on a mesh of the cluster's size
(:mod:`lamina.auto.cluster_plans`). This module has no step formula: it gives what a plan
does not say, the memory each rank holds, and the reasons a candidate cannot run the
model at all (:class:`NotApplicable`), before anything is planned.

From the measured :class:`~lamina.auto.measure.ModelProfile` (parameters, the
activations autograd saved on one rank's batch ``b``, the chain of blocks and its cut,
the attention calls, the MoE layers). The global batch is the same for every candidate:
``b`` rows per rank under data parallelism, ``b x tp`` per tensor-parallel group,
``b x pp`` per pipeline; a candidate whose data replicas cannot share it evenly cannot
run.

Memory per rank: parameters, gradients and AdamW's two moments (16 bytes per fp32
parameter, ``1/S`` of them when sharded ``S`` ways, ``1/T`` under tensor parallelism, one
stage's under ``pp``, ``1/E`` of the experts under ``ep``); plus what is gathered at once
(two ZeRO-3 units; a whole stage; one attention call's keys and values under ``cp``; the
tokens an MoE layer exchanges under ``ep``) and the activations autograd saved on the
batch (``pp``: one microbatch's per stage for each of the ``p`` microbatches in flight,
as ``m`` times less per microbatch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lamina.auto.candidates import Candidate
from lamina.auto.measure import ModelProfile
from lamina.simulate.step import PricedCollective

#: Bytes per parameter of the training state: fp32 weight, gradient, AdamW's two moments.
STATE_BYTES_PER_PARAM_BYTE = 4


@dataclass(frozen=True)
class CandidateMemory:
    """What :func:`predict_memory` predicts for one candidate: bytes per rank."""

    memory_bytes: int
    #: The memory's parts (bytes).
    memory_parts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CandidatePrediction:
    """One candidate's step, priced from its plan, and its memory per rank."""

    step_s: float
    memory_bytes: int
    #: The step's parts (seconds): compute, exposed communication, bubble, optimizer.
    parts: dict[str, float] = field(default_factory=dict)
    #: The memory's parts (bytes).
    memory_parts: dict[str, int] = field(default_factory=dict)
    #: The step's collectives as its plan issues them, priced.
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


def predict_memory(
    candidate: Candidate, profile: ModelProfile, global_rows: int | None = None
) -> CandidateMemory:
    """``candidate``'s memory per rank with ``global_rows`` rows per step (default: the
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
        return _expert_parallel(candidate, profile)
    if candidate.cp_degree > 1:
        return _context_parallel(candidate, profile)
    if candidate.pp_degree > 1:
        return _pipelined(candidate, profile)
    if candidate.tp_degree > 1:
        return _tensor_parallel(candidate, profile)
    if candidate.sharder is not None:
        return _sharded(candidate, profile, 1)
    state = profile.parameter_bytes * STATE_BYTES_PER_PARAM_BYTE
    return CandidateMemory(
        state + profile.activation_bytes,
        {"state": state, "activations": profile.activation_bytes},
    )


def _units(p: ModelProfile) -> int:
    return (p.chain.blocks if p.chain is not None else 0) + 1


def _sharded(c: Candidate, p: ModelProfile, split: float) -> CandidateMemory:
    """zero3 / hsdp over the sharder's axes on ``1/split`` of the parameters (``split``:
    the tensor-parallel degree, or the share of them an expert-parallel rank holds)."""
    sharder = c.sharder
    assert sharder is not None
    shards = c.size(sharder.shard)
    unit = p.parameter_bytes / split / _units(p)
    state = int(p.parameter_bytes * STATE_BYTES_PER_PARAM_BYTE // (split * shards))
    gathered = int(2 * unit)
    return CandidateMemory(
        state + gathered + p.activation_bytes,
        {"state": state, "gathered": gathered, "activations": p.activation_bytes},
    )


def _tensor_parallel(c: Candidate, p: ModelProfile) -> CandidateMemory:
    if p.chain is None:
        raise NotApplicable(f"tp splits the layers of blocks: {p.no_chain}")
    degree = c.tp_degree
    if c.sharder is not None:
        return _sharded(c, p, degree)
    state = p.parameter_bytes * STATE_BYTES_PER_PARAM_BYTE // degree
    return CandidateMemory(
        state + p.activation_bytes, {"state": state, "activations": p.activation_bytes}
    )


def _pipelined(c: Candidate, p: ModelProfile) -> CandidateMemory:
    from lamina.strategies.pp.cut import cut_stages

    chain = p.chain
    if chain is None:
        raise NotApplicable(f"pp cuts a chain of blocks: {p.no_chain}")
    stages, m = c.pp_degree, c.microbatches
    if stages > chain.blocks:
        raise NotApplicable(f"{stages} stages need {stages} blocks; the model has {chain.blocks}")
    rows = round(p.batch * stages)
    if rows % m:
        raise NotApplicable(f"the pipeline's {rows} rows do not split into {m} microbatches")
    per_micro = rows // m
    cut = cut_stages(chain.chain, stages, chain.costs)
    stage_bytes = []
    for span in cut.spans:
        size = sum(chain.block_bytes[span.start : span.stop])
        size += chain.prefix_bytes if span.start == 0 else 0
        size += chain.suffix_bytes if span.is_last else 0
        stage_bytes.append(size)
    biggest = max(stage_bytes)
    sharded = c.sharder is not None
    shards = c.size(c.sharder.shard) if c.sharder is not None else 1
    state = biggest * STATE_BYTES_PER_PARAM_BYTE // shards
    gathered = biggest if sharded else 0
    activations = int(p.activation_bytes * per_micro / p.batch)
    return CandidateMemory(
        state + gathered + activations,
        {"state": state, "gathered": gathered, "activations": activations},
    )


def _context_parallel(c: Candidate, p: ModelProfile) -> CandidateMemory:
    attention = p.attention
    if attention is None:
        raise NotApplicable(
            "cp splits attention: the forward calls no scaled_dot_product_attention"
        )
    degree = c.cp_degree
    tokens = attention.tokens
    if tokens % (2 * degree):
        raise NotApplicable(
            f"a sequence of {tokens} tokens does not split into {2 * degree} equal chunks"
        )
    # one replica's rows against the rows the calls were read on
    share = p.batch * degree / attention.rows
    largest = max((call.kv_bytes * share for call in attention.calls), default=0.0)
    outputs = attention.output_bytes * share
    base = _sharded(c, p, 1)
    memory = dict(base.memory_parts)
    memory["gathered keys and values"] = int(largest)
    memory["gathered outputs"] = int(outputs)
    return CandidateMemory(base.memory_bytes + int(largest + outputs), memory)


def _expert_parallel(c: Candidate, p: ModelProfile) -> CandidateMemory:
    experts = p.experts
    if experts is None:
        raise NotApplicable("ep spreads experts: the model has no Mixture-of-Experts layer")
    degree = c.ep_degree
    for layer in experts.layers:
        if layer.experts % degree:
            raise NotApplicable(f"{layer.experts} experts do not split over ep={degree}")
    dense = p.parameter_bytes - experts.expert_bytes
    held = dense + experts.expert_bytes / degree
    share = p.batch / experts.rows  # this rank's rows against the rows they were read on
    exchanged = [layer.exchange_bytes * share for layer in experts.layers]
    if c.sharder is not None:
        base = _sharded(c, p, p.parameter_bytes / held)
        memory, footprint = dict(base.memory_parts), base.memory_bytes
    else:
        state = int(held * STATE_BYTES_PER_PARAM_BYTE)
        memory = {"state": state, "activations": p.activation_bytes}
        footprint = state + p.activation_bytes
    buffers = int(2 * max(exchanged, default=0.0))
    memory["exchanged tokens"] = buffers
    return CandidateMemory(footprint + buffers, memory)


def fits(prediction: CandidatePrediction, device_memory: int | None, margin: float) -> bool:
    """Whether the predicted memory fits ``device_memory`` less its ``margin`` share."""
    return device_memory is None or prediction.memory_bytes <= device_memory * (1 - margin)


__all__ = [
    "STATE_BYTES_PER_PARAM_BYTE",
    "CandidateMemory",
    "CandidatePrediction",
    "NotApplicable",
    "fits",
    "predict_memory",
]
