"""Training with ``codec="fp8"``: DP's two-phase sum over the whole group and between
hosts only (``codec_scope="inter"``), ZeRO-3's reduce-scatter and HSDP's all-reduce
across the replicas, beside torch DDP; the error feedback in the plan, and the fallback
a flagged bucket or unit takes on every rank in the same step. One job of 4 gloo ranks
laid out as 2 hosts x 2, interleaved (ranks 0, 2 on one host; the ``inter`` x ``intra``
mesh from the topology), as in ``test_dp_algorithms``.

Every step's gradient is compared with DDP's at the same weights (relative L2: fp8's
quantization error, or none for a step that fell back), so a mean off by a factor fails
where AdamW would hide it in the parameters. One step of each fp8 run and one fp32 step
of each strategy are measured where they cross (:class:`lamina.testing.WireCounter`):
the bytes and dtypes handed to ``torch.distributed``, against each other and against
what the trace recorded (for the cast codecs too)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.comm.codecs import Fp8Codec
from lamina.comm.fp8 import BLOCK, padded_numel
from lamina.errors import ConfigError
from lamina.runtime.render import explain
from lamina.testing import WireCounter, WireRecord, run_ranks
from lamina.trace import recorder
from models_for_tests import batch, build, loss_of, relative_grad_l2
from test_dp_algorithms import BUCKETS, STEPS
from topologies_for_tests import two_hosts_interleaved

pytestmark = [pytest.mark.portable, pytest.mark.multiprocess, pytest.mark.cross_release]

WORLD = 4
#: The step at which rank 1's loss is scaled past the codec's overflow bound.
OVERFLOW_STEP = 2
#: The step of each fp8 run measured on the wire: the capture and the setup broadcasts
#: are behind it and the error feedback runs.
MEASURED = STEPS - 1
#: An fp8 element takes 1 byte where fp32 takes 4, plus one int8 exponent per block of
#: 128: the fp8 sums send (1 + 1/128) / 4 = 0.2520 of fp32's bytes, times the padding of
#: the buffers to whole blocks. Both phases count: an fp32 all-reduce sends its buffer
#: twice (reduce-scatter and all-gather: 2(n-1)/n of it per rank), the two-phase sum its
#: quantized buffer once in the all_to_all and once in the all-gather ((n-1)/n each).
FP8_PER_FP32 = (1 + 1 / BLOCK) / 4
#: Relative L2 of a step's gradient against DDP's at the same weights. fp8: e4m3 keeps 3
#: mantissa bits (~2.6e-2 per quantization; each rank's contribution, then the sum):
#: measured 0.031-0.040 at the first step. Error feedback then adds what the step before
#: lost and takes out what this one loses: two independent errors of that size, sqrt(2)
#: times one (measured 0.039-0.059); the step after a fallback carries the residual of
#: the step before that, taken on another gradient (measured 0.063-0.092). A mean off by
#: a factor (divided or summed twice) is 0.5 or more. A step reduced exactly (the
#: fallback) differs from DDP in the fp32 rounding order only (measured 0 to 4e-8).
FP8_GRAD_TOLERANCE = 5e-2
FEEDBACK_GRAD_TOLERANCE = FP8_GRAD_TOLERANCE * 2**0.5
AFTER_FALLBACK_GRAD_TOLERANCE = 2 * FP8_GRAD_TOLERANCE
EXACT_GRAD_TOLERANCE = 1e-6


def _crosses_hosts(record: WireRecord) -> bool:
    """A call on a 2-rank group whose ranks are on the two hosts (interleaved: rank r on
    host r % 2): the inter-host phase or HSDP's replicas."""
    return record.group_size == 2 and len({r % 2 for r in record.group}) == 2


def _inside_a_host(record: WireRecord) -> bool:
    return record.group_size == 2 and len({r % 2 for r in record.group}) == 1


def _measure(trace: recorder.TraceRecorder, run: Any) -> dict[str, Any]:
    """``run()`` (one forward and backward) under a :class:`WireCounter`: every call it
    handed to ``torch.distributed``, and the bytes per dtype the trace recorded for the
    collectives it issued."""
    first = len(trace.events())
    with WireCounter() as wire:
        run()
    events = trace.events()[first:]
    traced: dict[str, int] = {}
    for event in events:
        for dtype, nbytes in (event.wire or {}).items():
            traced[dtype] = traced.get(dtype, 0) + nbytes
    return {
        "records": wire.records,
        "wire": wire.by_dtype(),
        "traced": traced,
        "events": len(events),
        "untraced": [e.node for e in events if e.wire is None],
    }


def _weights(ours: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``ours``' parameters, whole, by name: the sharded ones gathered unit by unit (the
    engine's own gather: a few collectives, not one per parameter)."""
    engine = getattr(ours, "lamina_engine", None)
    if engine is None:
        return dict(ours.named_parameters())
    return {n: v for u in engine.units for n, v in u.layout.views(u.gather_master()).items()}


def _grad_error(
    ours: torch.nn.Module, ref: torch.nn.Module, step: int, overflowing: bool = False
) -> float:
    """Relative L2 of ``ours``' gradients against DDP's at ``ours``' weights: the mean
    over the ranks of each rank's gradient on its batch of ``step``, all computed here on
    the plain model ``ref`` (``overflowing``: rank 1's loss scaled as it was)."""
    with torch.no_grad():
        for name, value in _weights(ours).items():
            ref.get_parameter(name).copy_(value)
    mean = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for rank in range(WORLD):
        x, y = batch("gpt", step, rank)
        scale = 1e6 if overflowing and rank == 1 else 1.0
        ref.zero_grad(set_to_none=True)
        (scale * loss_of("gpt", ref(x), y)).backward()
        for name, param in ref.named_parameters():
            assert param.grad is not None
            mean[name] += param.grad / WORLD
    return relative_grad_l2(ours, mean)


def _beside_ddp(
    ours: torch.nn.Module,
    inner: torch.nn.Module,
    initial: torch.nn.Module,
    rank: int,
    trace: recorder.TraceRecorder,
) -> tuple[DDP, list[float], dict[str, Any]]:
    """``STEPS`` AdamW steps of ``ours`` (whose user module is ``inner``) and of torch DDP
    (from ``initial``) on the same batches; returns the DDP model, each step's gradient
    error against DDP's at ``ours``' weights, and the step measured on the wire."""
    ddp, ref = DDP(copy.deepcopy(initial)), build("gpt")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, ddp)]
    errors: list[float] = []
    measured: dict[str, Any] = {}
    for step in range(STEPS):
        x, y = batch("gpt", step, rank)

        def backward(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            loss_of("gpt", ours(x), y).backward()

        if step == MEASURED:
            measured = _measure(trace, backward)
        else:
            backward()
        loss_of("gpt", ddp(x), y).backward()
        errors.append(_grad_error(inner, ref, step))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return ddp, errors, measured


def _digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bits: equal on every rank or not."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def relative_drift(ours: list[torch.Tensor], ddp: torch.nn.Module) -> float:
    """How far ``ours`` (full state tensors) ended from DDP's, relative to how far DDP's
    moved from the initialization both started from (rank 0's, broadcast)."""
    start = build("gpt", seed=0).state_dict().values()
    theirs = list(ddp.module.state_dict().values())
    moved = torch.cat([(b - a).reshape(-1) for a, b in zip(start, theirs, strict=True)])
    apart = torch.cat([(a - b).reshape(-1) for a, b in zip(ours, theirs, strict=True)])
    return float(apart.norm() / moved.norm())


def _bucket_events(trace: recorder.TraceRecorder) -> list[Any]:
    return [e for e in trace.events() if e.node.startswith("bucket")]


def _against_ddp(rank: int, **options: Any) -> dict[str, Any]:
    """``STEPS`` AdamW steps beside DDP, traced; what the test checks."""
    initial = build("gpt", seed=rank)
    trace = recorder.start(recorder.TraceRecorder(rank, WORLD))
    try:
        ours = lamina.distribute(copy.deepcopy(initial), "dp", **options, **BUCKETS)
        ddp, errors, measured = _beside_ddp(ours, ours.module, initial, rank, trace)
        events = _bucket_events(trace)
    finally:
        recorder.stop(write=False)
    plan = ours.execution_plan
    buckets = [n for n in plan.collectives() if n.id.startswith("bucket")]
    return {
        "grad_errors": errors,
        "measured": measured,
        "bucket_numels": [n.collective.numel for n in buckets],
        "drift": relative_drift(list(ours.module.state_dict().values()), ddp),
        "digest": _digest(ours.module),
        "codec": [n.codec.name if n.codec else "none" for n in buckets],
        "algorithms": [n.algorithm.name if n.algorithm else "flat" for n in buckets],
        "residual_bytes": sum(n.codec.residual_bytes for n in buckets if n.codec),
        "meta": dict(plan.meta),
        "bytes": sum(e.bytes for e in events if e.step == STEPS - 1),
        "uncompressed": sum(n.collective.numel * n.collective.element_size for n in buckets),
        "codec_stats": [e.codec for e in events if e.codec is not None],
        "held": ours.reducer.residual_bytes(),
        "fallbacks": list(ours.run_log.events),
        "explained": explain(plan),
    }


def _overflow(rank: int) -> dict[str, Any]:
    """fp8 with a low overflow bound: rank 1's loss is scaled past it at one step."""
    codec = Fp8Codec(overflow_at=1e3)
    model = lamina.distribute(build("gpt", seed=0), "dp", codec=codec, **BUCKETS)
    ref = build("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    summaries, errors = [], []
    for step in range(STEPS):
        x, y = batch("gpt", step, rank)
        scale = 1e6 if step == OVERFLOW_STEP and rank == 1 else 1.0
        (scale * loss_of("gpt", model(x), y)).backward()
        summaries.append(model.step_summary())
        errors.append(_grad_error(model.module, ref, step, step == OVERFLOW_STEP))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "grad_errors": errors,
        "digest": _digest(model.module),
        "fallback_steps": sorted({e.step for e in model.run_log.events}),
        "fallbacks": [(e.step, e.node, e.primary, e.alternative) for e in model.run_log.events],
        "buckets": len(model.plan.buckets),
        "summaries": summaries,
    }


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [v.full_tensor() for v in model.state_dict().values()]


def _sharded_against_ddp(strategy: str, rank: int) -> dict[str, Any]:
    initial = build("gpt", seed=rank)
    trace = recorder.start(recorder.TraceRecorder(rank, WORLD))
    try:
        ours = lamina.distribute(copy.deepcopy(initial), strategy, codec="fp8", min_unit_numel=0)
        ddp, errors, measured = _beside_ddp(ours, ours, initial, rank, trace)
        events = [e for e in trace.events() if e.codec is not None]
    finally:
        recorder.stop(write=False)
    full = _full(ours)
    plan = ours.execution_plan
    return {
        "grad_errors": errors,
        "measured": measured,
        "drift": relative_drift(full, ddp),
        "full": [t.clone() for t in full],
        "compressed": sorted(
            {n.id.rsplit(".", 1)[-1] for n in plan.collectives() if n.codec is not None}
        ),
        "error_feedback_bytes": int(dict(plan.meta).get("error_feedback_bytes", 0)),
        "roles": sorted({e.codec["role"] for e in events}),
        "used": all(e.codec["used"] for e in events),
        "fallbacks": len(ours.run_log.events),
    }


def _sharded_overflow(rank: int) -> dict[str, Any]:
    """ZeRO-3 with a low overflow bound: rank 1's loss is scaled past it at one step."""
    model = lamina.distribute(
        build("gpt", seed=0), "zero3", codec=Fp8Codec(overflow_at=1e3), min_unit_numel=0
    )
    ref = build("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    errors = []
    for step in range(STEPS):
        x, y = batch("gpt", step, rank)
        scale = 1e6 if step == OVERFLOW_STEP and rank == 1 else 1.0
        (scale * loss_of("gpt", model(x), y)).backward()
        errors.append(_grad_error(model, ref, step, step == OVERFLOW_STEP))
        opt.step()
        opt.zero_grad(set_to_none=True)
    scatters = [n for n in model.execution_plan.collectives() if n.id.endswith("reduce_scatter")]
    return {
        "grad_errors": errors,
        "full": _full(model),
        "steps": sorted({e.step for e in model.run_log.events}),
        "events": len(model.run_log.events),
        "units": len(scatters),
    }


#: The runs measured for one step without fp8: each strategy in fp32 on the GPT of the fp8
#: runs (dp on the cost model's algorithm, hierarchical here), and the cast codecs on the
#: MLP (bf16 on the flat all-reduce, fp16 on the hierarchical one).
UNCOMPRESSED: dict[str, tuple[str, str, dict[str, Any]]] = {
    "dp": ("gpt", "dp", BUCKETS),
    "zero3": ("gpt", "zero3", {"min_unit_numel": 0}),
    "hsdp": ("gpt", "hsdp", {"min_unit_numel": 0}),
    "bf16": ("mlp", "dp", {"codec": "bf16", "algorithm": "flat", **BUCKETS}),
    "fp16": ("mlp", "dp", {"codec": "fp16", "algorithm": "hierarchical", **BUCKETS}),
}


def _uncompressed(rank: int) -> dict[str, dict[str, Any]]:
    """Each run of :data:`UNCOMPRESSED`: a first step (the capture, the setup broadcasts),
    then one measured on the wire."""
    out: dict[str, dict[str, Any]] = {}
    trace = recorder.start(recorder.TraceRecorder(rank, WORLD))
    try:
        for key, (name, strategy, options) in UNCOMPRESSED.items():
            model = lamina.distribute(build(name, seed=0), strategy, **options)
            for step in range(2):
                x, y = batch(name, step, rank)

                def backward(name: str = name, model: Any = model, x: Any = x, y: Any = y) -> None:
                    loss_of(name, model(x), y).backward()

                if step == 1:
                    out[key] = _measure(trace, backward)
                else:
                    backward()
                model.zero_grad(set_to_none=True)
            plan = model.execution_plan
            out[key]["algorithms"] = sorted(
                {
                    n.algorithm.name if n.algorithm else "flat"
                    for n in plan.collectives()
                    if n.phase != "setup"
                }
            )
    finally:
        recorder.stop(write=False)
    return out


def _job() -> dict[str, Any]:
    runtime = lamina.init(mesh="topology")
    try:
        lamina.distribute(build("mlp", seed=0), "zero3", codec="bf16")
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    return {
        "fp8": _against_ddp(runtime.rank, codec="fp8"),
        "inter": _against_ddp(runtime.rank, codec="fp8", codec_scope="inter"),
        "overflow": _overflow(runtime.rank),
        "zero3": _sharded_against_ddp("zero3", runtime.rank),
        "hsdp": _sharded_against_ddp("hsdp", runtime.rank),
        "sharded_overflow": _sharded_overflow(runtime.rank),
        "uncompressed": _uncompressed(runtime.rank),
        "refused": refused,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path: Path = tmp_path_factory.mktemp("fp8-training") / "interleaved.json"
    path.write_text(json.dumps(two_hosts_interleaved()))
    return run_ranks(_job, WORLD, env={"LAMINA_TOPOLOGY": str(path)}, timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("variant", ["fp8", "inter"])
def test_fp8_trains_like_ddp_and_equal_on_every_rank(
    results: list[dict[str, Any]], variant: str
) -> None:
    for rank, result in enumerate(results):
        assert result[variant]["digest"] == results[0][variant]["digest"], rank
        # AdamW's first steps move small gradients by about lr whatever their size, so
        # e4m3's ~3% per-step error shows: measured 0.075 (fp8) and 0.057 (inter)
        assert result[variant]["drift"] < 0.1, (rank, result[variant]["drift"])
        assert result[variant]["fallbacks"] == [], rank
    assert set(results[0][variant]["codec"]) == {"fp8"}


@pytest.mark.timeout(360)
def test_fp8_moves_a_quarter_of_the_bytes_in_the_trace(results: list[dict[str, Any]]) -> None:
    fp8 = results[0]["fp8"]  # against what the fp32 buckets would carry
    assert 0.25 <= fp8["bytes"] / fp8["uncompressed"] <= 0.27, (fp8["bytes"], fp8["uncompressed"])
    stats = fp8["codec_stats"]
    assert stats and all(s["used"] and s["scope"] == "all" for s in stats)
    assert all(0 < s["error_in"] < 0.06 and s["overflow"] == 0 for s in stats), stats


@pytest.mark.timeout(360)
def test_error_feedback_memory_is_in_the_plan_and_held(results: list[dict[str, Any]]) -> None:
    for variant in ("fp8", "inter"):
        result = results[0][variant]
        assert result["residual_bytes"] > 0
        assert int(result["meta"]["error_feedback_bytes"]) == result["residual_bytes"]
        assert result["held"] == result["residual_bytes"], variant
    assert "gradient codec (error feedback holds" in results[0]["fp8"]["explained"]
    assert "codec:fp8 -> fp32" in results[0]["fp8"]["explained"]
    # between hosts only: the residuals of the 1/2 shard summed over 2 hosts
    assert results[0]["inter"]["residual_bytes"] < results[0]["fp8"]["residual_bytes"]


@pytest.mark.timeout(360)
def test_inter_scope_keeps_the_hierarchical_algorithm(results: list[dict[str, Any]]) -> None:
    inter = results[0]["inter"]
    assert set(inter["algorithms"]) <= {"hierarchical", "pipelined"}, inter["algorithms"]
    assert all(s["scope"] == "inter" and s["used"] for s in inter["codec_stats"])
    assert set(results[0]["fp8"]["algorithms"]) == {"flat"}  # the two-phase sum is its own


@pytest.mark.timeout(360)
def test_a_flagged_bucket_falls_back_on_every_rank_in_the_same_step(
    results: list[dict[str, Any]],
) -> None:
    overflow = [r["overflow"] for r in results]
    for rank, result in enumerate(overflow):
        assert result["digest"] == overflow[0]["digest"], rank
        # the run log counts the setup broadcasts as step 0
        assert result["fallback_steps"] == [OVERFLOW_STEP + 1], (rank, result["fallbacks"])
        assert len(result["fallbacks"]) == result["buckets"], rank
        assert all(f[2:] == ("codec:fp8", "fp32") for f in result["fallbacks"])
        assert "run fallbacks" in result["summaries"][OVERFLOW_STEP]
        assert "run fallbacks" not in result["summaries"][OVERFLOW_STEP + 1]
    assert "passes overflow_at=1000" in overflow[1]["summaries"][OVERFLOW_STEP]
    assert "another rank flagged it" in overflow[0]["summaries"][OVERFLOW_STEP]


@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("strategy", "compressed"), [("zero3", "reduce_scatter"), ("hsdp", "replicas")]
)
def test_sharded_fp8_trains_like_ddp_on_every_rank(
    results: list[dict[str, Any]], strategy: str, compressed: str
) -> None:
    for rank, result in enumerate(results):
        ours = result[strategy]
        for a, b in zip(ours["full"], results[0][strategy]["full"], strict=True):
            assert torch.equal(a, b), rank
        assert ours["drift"] < 0.1, (rank, ours["drift"])  # e4m3 under AdamW, as in dp
        assert ours["compressed"] == [compressed]
        assert ours["error_feedback_bytes"] > 0 and ours["used"] and ours["fallbacks"] == 0
    roles = {"zero3": ["scatter"], "hsdp": ["replicate"]}[strategy]
    assert results[0][strategy]["roles"] == roles


@pytest.mark.timeout(360)
def test_a_flagged_unit_falls_back_on_every_rank_in_the_same_step(
    results: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(results):
        overflow = result["sharded_overflow"]
        assert overflow["steps"] == [OVERFLOW_STEP + 1], rank  # step 0: the setup
        assert overflow["events"] == overflow["units"], rank
        for a, b in zip(overflow["full"], results[0]["sharded_overflow"]["full"], strict=True):
            assert torch.equal(a, b), rank


@pytest.mark.timeout(360)
def test_cast_codecs_are_refused_by_the_sharded_strategies(
    results: list[dict[str, Any]],
) -> None:
    assert "zero3 and hsdp compress gradients with a two-phase codec only" in results[0]["refused"]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", ["fp8", "inter", "zero3", "hsdp", "overflow", "sharded_overflow"])
def test_every_steps_gradients_are_ddps_up_to_the_fp8_error(
    results: list[dict[str, Any]], run: str
) -> None:
    for rank, result in enumerate(results):
        errors = result[run]["grad_errors"]
        assert len(errors) == STEPS, (rank, errors)
        fell_back = run.endswith("overflow")
        for step, error in enumerate(errors):
            if fell_back and step == OVERFLOW_STEP:  # reduced exactly
                assert error <= EXACT_GRAD_TOLERANCE, (rank, step, errors)
                continue
            bound = FEEDBACK_GRAD_TOLERANCE if step else FP8_GRAD_TOLERANCE
            if fell_back and step == OVERFLOW_STEP + 1:
                bound = AFTER_FALLBACK_GRAD_TOLERANCE
            assert 1e-2 < error <= bound, (rank, step, errors)  # quantized, no worse than e4m3


def _everything(record: WireRecord) -> bool:
    return True


def _all_to_all(record: WireRecord) -> bool:
    return record.op == "all_to_all"


#: fp8 run -> (the fp32 run it is measured against, the calls the codec compresses): all
#: of dp's, the inter-host phase, ZeRO-3's reduce-scatter (an all_to_all on gloo; its
#: gathers are broadcasts) and HSDP's all-reduce across the replicas.
COMPRESSED = {
    "fp8": ("dp", _everything),
    "inter": ("dp", _crosses_hosts),
    "zero3": ("zero3", _all_to_all),
    "hsdp": ("hsdp", _crosses_hosts),
}


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", list(COMPRESSED))
def test_fp8_sends_a_quarter_of_the_fp32_bytes_measured_on_the_wire(
    results: list[dict[str, Any]], run: str
) -> None:
    baseline, compressed = COMPRESSED[run]
    for rank, result in enumerate(results):
        fp8 = [r for r in result[run]["measured"]["records"] if compressed(r)]
        fp32 = [r for r in result["uncompressed"][baseline]["records"] if compressed(r)]
        # the compressed collectives carry the e4m3 payload and its exponents, nothing else
        assert fp8 and {r.dtype for r in fp8} == {"uint8", "int8"}, (rank, fp8)
        assert fp32 and {r.dtype for r in fp32} == {"float32"}, (rank, fp32)
        payload = sum(r.bytes for r in fp8 if r.dtype == "uint8")
        assert sum(r.bytes for r in fp8 if r.dtype == "int8") * BLOCK == payload  # 1 per block
        ratio = sum(r.sent() for r in fp8) / sum(r.sent() for r in fp32)
        # padding to whole blocks adds at most 3% here (measured: dp and inter 2.6%,
        # hsdp 0.9%, zero3 none)
        assert FP8_PER_FP32 <= ratio <= FP8_PER_FP32 * 1.03, (rank, ratio)


@pytest.mark.timeout(360)
def test_fp8_pads_each_bucket_to_whole_blocks_and_nothing_more(
    results: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(results):
        fp8 = result["fp8"]
        records = fp8["measured"]["records"]
        # each bucket's payload, padded to whole blocks in each of the 4 chunks, crosses
        # twice: in the all_to_all and in the all-gather (one broadcast per rank on gloo)
        padded = sum(padded_numel(n, WORLD) for n in fp8["bucket_numels"])
        assert sum(r.bytes for r in records if r.dtype == "uint8") == 2 * padded, rank
        assert {r.op for r in records} == {"all_to_all", "broadcast"}, rank
        inter = result["inter"]["measured"]["records"]
        assert {r.dtype for r in inter if _inside_a_host(r)} == {"float32"}, rank


#: Every step measured on the wire: the fp8 runs', and the uncompressed runs'.
MEASURED_RUNS = [*COMPRESSED, *(f"uncompressed/{k}" for k in UNCOMPRESSED)]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", MEASURED_RUNS)
def test_the_trace_records_the_bytes_that_crossed(results: list[dict[str, Any]], run: str) -> None:
    for rank, result in enumerate(results):
        part, _, key = run.partition("/")
        measured = result[part][key] if key else result[part]["measured"]
        assert measured["events"] > 0 and measured["untraced"] == [], (rank, measured)
        assert measured["traced"] == measured["wire"], (rank, measured["traced"], measured["wire"])
