"""Every declared fallback edge of the execution plan: forced, recorded, and still correct.

Each test forces one trigger on 2 real ranks and checks three things: the plan (plan-time
edges) or the run log and ``step_summary()`` (run-time edges) say which alternative ran
and why; and training on the alternative ends with the parameters the primary path
gives. Spawning ranks is the slow part, so one job runs every DP configuration
(capture, compile, codec) and one every ZeRO-3 primitive configuration; the tests, one
per edge, assert on their results.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.comm.codecs import Codec
from lamina.testing import run_ranks
from models_for_tests import MLP, NeedsFx, NeedsHooks, batch, build, loss_of

STEPS = 3
WORLD = 2
#: Every job starts from a clean lamina configuration, whatever the calling shell sets.
CLEAN_ENV = {
    "LAMINA_BACKEND": "cpu",
    "LAMINA_DISABLE_COLLECTIVES": "",
    "LAMINA_PLAN_OUT": "",
    "LAMINA_VERIFY_ONLY": "",
}
#: Small bucket caps: the MLP's gradients land in several buckets, each with its node.
SMALL_BUCKETS: dict[str, Any] = {"bucket_cap_mb": 0.004, "first_bucket_mb": 0.001}
#: fp16 tops out at 65504; gradients of a loss scaled by 2**30 are far past that, while
#: bf16 (fp32's exponent range) carries them. SGD's step is scaled down by as much.
LOSS_SCALE = 2.0**30
SGD_LR = 0.1 / LOSS_SCALE


# -- models that force the compile and codec fallbacks --------------------------------
class BreaksCompile(MLP):
    """The tests' MLP (same parameters from the same seed) with a graph break in forward:
    eager, export and fx run it unchanged; ``torch.compile(fullgraph=True)`` refuses it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x)


class BrokenCodec(Codec):
    """A user codec whose encoder raises: it fails the self-check while planning."""

    name = "broken"
    wire_dtype = torch.float16
    tolerance = 1e-3

    def __init__(self) -> None:
        self.encode_calls = 0

    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        self.encode_calls += 1
        raise RuntimeError("encoder unavailable on this device")

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(wire)


# -- helpers run on every rank -----------------------------------------------------------
def _params(model: nn.Module) -> list[list[float]]:
    """Flat parameter values as floats (tensors cannot leave a rank that exits: torch
    pickles them as shared memory that goes away with the process)."""
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _tensors(values: list[list[float]]) -> list[torch.Tensor]:
    """Parameters returned by a rank, back as float32 tensors (exact: they were float32)."""
    return [torch.tensor(v, dtype=torch.float32) for v in values]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = zip(_tensors(a), _tensors(b), strict=True)
    return max((x - y).abs().max().item() for x, y in pairs)


def _small_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)


def _fallbacks(plan: Any, node: str) -> list[tuple[str, str, str, bool, str]]:
    return [(f.primary, f.alternative, f.when, f.taken, f.reason) for f in plan.fallbacks_of(node)]


def _train_mlp(model: nn.Module, rank: int, *, sgd: bool = False, scale: float = 1.0) -> list[str]:
    """STEPS steps on the tests' MLP batches; the step summary after each step."""
    if sgd:
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    summaries = []
    for step in range(STEPS):
        x, y = batch("mlp", step, rank)
        (loss_of("mlp", model(x), y) * scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        summary = getattr(model, "step_summary", None)
        summaries.append(summary() if summary is not None else "")
    return summaries


# -- one spawned job for the DP edges ----------------------------------------------------
Results = dict[str, dict[str, dict[str, Any]]]


def _dp_job() -> Results:
    """Every DP configuration on this rank: capture, compile and codec families."""
    rank = lamina.init().rank
    return {"capture": _capture_job(rank), "compile": _compile_job(rank), "codec": _codec_job(rank)}


@pytest.fixture(scope="module")
def dp_results() -> list[Results]:
    return run_ranks(_dp_job, WORLD, env=CLEAN_ENV, timeout=100)


# -- capture export -> fx -> hooks ----------------------------------------------------
def _capture_job(rank: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    models = {"fx": lambda: NeedsFx(8, 16, 8), "hooks": lambda: NeedsHooks(8, 8)}
    for name, make in models.items():
        torch.manual_seed(0)
        reference = make()
        example = _small_batch(0, rank)[0]
        ours = lamina.distribute(copy.deepcopy(reference), "dp", example_inputs=(example,))
        ddp = DDP(reference)
        for model in (ours, ddp):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(STEPS):
                x, y = _small_batch(step, rank)
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        plan = ours.execution_plan
        out[name] = {
            "method": ours.graph.method,
            "capture_attr": plan.node("forward").attr("capture"),
            "fallbacks": _fallbacks(plan, "forward"),
            "summary": ours.step_summary(),
            "events": list(ours.run_log.events),
            "ours": _params(ours.module),
            "ddp": _params(ddp.module),
        }
    return out


@pytest.fixture(scope="module")
def capture_results(dp_results: list[Results]) -> list[dict[str, dict[str, Any]]]:
    return [r["capture"] for r in dp_results]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_export_falls_back_to_fx_and_trains_like_ddp(
    capture_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in capture_results:
        fx = result["fx"]
        assert fx["method"] == "fx" and fx["capture_attr"] == "fx"
        (to_fx, to_hooks) = fx["fallbacks"]
        assert to_fx[:4] == ("capture:export", "capture:fx", "plan", True)
        assert "data-dependent" in to_fx[4].lower() and "\n" not in to_fx[4]
        assert to_hooks[:4] == ("capture:fx", "capture:hooks", "plan", False)
        assert "plan fallbacks: capture:export -> capture:fx (x1)" in fx["summary"]
        assert fx["events"] == []
        torch.testing.assert_close(_tensors(fx["ours"]), _tensors(fx["ddp"]), rtol=0, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fx_falls_back_to_hooks_and_trains_like_ddp(
    capture_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in capture_results:
        hooks = result["hooks"]
        assert hooks["method"] == "hooks" and hooks["capture_attr"] == "hooks"
        (to_fx, to_hooks) = hooks["fallbacks"]
        assert to_fx[:4] == ("capture:export", "capture:fx", "plan", True)
        assert "data-dependent" in to_fx[4].lower()
        assert to_hooks[:4] == ("capture:fx", "capture:hooks", "plan", True)
        assert to_hooks[4].startswith("TraceError") and "\n" not in to_hooks[4]
        both = "capture:export -> capture:fx (x1); capture:fx -> capture:hooks (x1)"
        assert f"plan fallbacks: {both}" in hooks["summary"]
        torch.testing.assert_close(
            _tensors(hooks["ours"]), _tensors(hooks["ddp"]), rtol=0, atol=1e-6
        )
    # the ranks hold the same model, although the branch went different ways on them
    assert capture_results[0]["hooks"]["ours"] == capture_results[1]["hooks"]["ours"]


# -- compiled forward -> eager --------------------------------------------------------
def _compile_job(rank: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, model, compile_ in (
        ("eager", build("mlp"), False),
        ("compiled", build("mlp"), "eager"),
        ("breaks", _built(BreaksCompile), "eager"),
    ):
        wrapped = lamina.distribute(model, "dp", compile=compile_, **SMALL_BUCKETS)
        summaries = _train_mlp(wrapped, rank)
        plan = wrapped.execution_plan
        out[name] = {
            "summaries": summaries,
            "events": list(wrapped.run_log.events),
            "fallbacks": _fallbacks(plan, "forward"),
            "mode": plan.node("forward").attr("mode"),
            "failed": wrapped._forward.failed if wrapped._forward is not None else None,
            "params": _params(wrapped.module),
        }
    return out


def _built(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


@pytest.fixture(scope="module")
def compile_results(dp_results: list[Results]) -> list[dict[str, dict[str, Any]]]:
    return [r["compile"] for r in dp_results]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_compile_failure_falls_back_to_eager_with_the_same_parameters(
    compile_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in compile_results:
        breaks, eager = result["breaks"], result["eager"]
        assert breaks["mode"] == "compiled:eager" and breaks["failed"] is True
        declared = [f for f in breaks["fallbacks"] if f[2] == "run"]
        assert declared == [("compiled:eager", "eager", "run", False, "")]
        (event,) = breaks["events"]  # recorded once, on the first call; later calls are eager
        assert (event.step, event.node, event.primary, event.alternative) == (
            1,
            "forward",
            "compiled:eager",
            "eager",
        )
        assert "graph_break" in event.reason and "\n" not in event.reason
        recorded = f"run fallbacks: forward compiled:eager -> eager ({event.reason})"
        assert recorded in breaks["summaries"][0]  # the summary of step 1
        assert "run fallbacks" not in breaks["summaries"][-1]
        assert eager["events"] == [] and eager["mode"] == "eager"
        # the failed first call left no trace: the same numbers as never compiling
        torch.testing.assert_close(
            _tensors(breaks["params"]), _tensors(eager["params"]), rtol=0, atol=0
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_compile_that_works_records_no_fallback_and_matches_eager(
    compile_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in compile_results:
        compiled, eager = result["compiled"], result["eager"]
        assert compiled["mode"] == "compiled:eager" and compiled["failed"] is False
        assert compiled["events"] == []
        assert all("fallbacks" not in s for s in compiled["summaries"])
        assert not any(f[3] for f in compiled["fallbacks"])  # nothing taken, capture included
        torch.testing.assert_close(
            _tensors(compiled["params"]), _tensors(eager["params"]), rtol=0, atol=1e-6
        )


# -- codecs -> uncompressed -------------------------------------------------------------
def _codec_job(rank: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in ("none", "broken", "fp16", "bf16"):
        codec: str | Codec | None = {"none": None, "broken": BrokenCodec()}.get(name, name)
        wrapped = lamina.distribute(build("mlp"), "dp", codec=codec, **SMALL_BUCKETS)
        summaries = _train_mlp(wrapped, rank, sgd=True, scale=LOSS_SCALE)
        plan = wrapped.execution_plan
        buckets = [n for n in plan.collectives() if n.id.startswith("bucket")]
        out[name] = {
            "buckets": [n.id for n in buckets],
            "codec_attr": [n.attr("codec") for n in buckets],
            "wire": [n.collective.wire_dtype for n in buckets],
            "fallbacks": {n.id: _fallbacks(plan, n.id) for n in buckets},
            "events": list(wrapped.run_log.events),
            "codec_fallbacks": wrapped.reducer.stats.codec_fallbacks,
            "summaries": summaries,
            "encode_calls": codec.encode_calls if isinstance(codec, BrokenCodec) else None,
            "params": _params(wrapped.module),
        }
    return out


@pytest.fixture(scope="module")
def codec_results(dp_results: list[Results]) -> list[dict[str, dict[str, Any]]]:
    return [r["codec"] for r in dp_results]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_codec_failing_its_self_check_is_replaced_by_the_uncompressed_all_reduce(
    codec_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in codec_results:
        broken, plain = result["broken"], result["none"]
        assert len(broken["buckets"]) >= 2 and broken["buckets"] == plain["buckets"]
        assert broken["codec_attr"] == ["none"] * len(broken["buckets"])
        assert broken["wire"] == [None] * len(broken["buckets"])
        for node, fallbacks in broken["fallbacks"].items():
            # taken while planning; no run-time overflow check for a codec that is not used
            ((primary, alternative, when, taken, reason),) = fallbacks
            assert (primary, alternative, when, taken) == (
                "codec:broken",
                "uncompressed",
                "plan",
                True,
            ), node
            assert reason == (
                "codec broken failed its self-check: RuntimeError: encoder unavailable on this "
                "device"
            )
        assert broken["encode_calls"] == 1  # the self-check only; training never encodes
        assert broken["events"] == [] and broken["codec_fallbacks"] == 0
        taken = f"plan fallbacks: codec:broken -> uncompressed (x{len(broken['buckets'])})"
        assert taken in broken["summaries"][-1]
        torch.testing.assert_close(
            _tensors(broken["params"]), _tensors(plain["params"]), rtol=0, atol=0
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fp16_overflow_is_resent_uncompressed_with_the_same_parameters(
    codec_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in codec_results:
        fp16, plain = result["fp16"], result["none"]
        buckets = fp16["buckets"]
        assert fp16["codec_attr"] == ["fp16"] * len(buckets)
        assert fp16["wire"] == ["float16"] * len(buckets)
        for node in buckets:
            plan_time, run_time = fp16["fallbacks"][node]
            assert plan_time[1:4] == ("uncompressed", "plan", False)  # passed its self-check
            assert run_time[:4] == ("codec:fp16", "uncompressed", "run", False)
        # every bucket overflowed on every step, so every reduction was the fp32 one
        assert fp16["codec_fallbacks"] == len(buckets) * STEPS
        events = fp16["events"]
        assert sorted((e.step, e.node) for e in events) == sorted(
            (step, node) for step in range(1, STEPS + 1) for node in buckets
        )
        for event in events:
            assert (event.primary, event.alternative) == ("codec:fp16", "uncompressed")
            assert event.reason == "codec fp16 overflowed: resent uncompressed"
        for step, summary in enumerate(fp16["summaries"], start=1):
            assert f"step {step}: " in summary
            for node in buckets:
                assert (
                    f"{node} codec:fp16 -> uncompressed (codec fp16 overflowed: resent "
                    "uncompressed)" in summary
                )
        torch.testing.assert_close(
            _tensors(fp16["params"]), _tensors(plain["params"]), rtol=0, atol=0
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bf16_codec_carries_the_same_gradients_without_a_fallback(
    codec_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in codec_results:
        bf16, plain = result["bf16"], result["none"]
        assert bf16["codec_attr"] == ["bf16"] * len(bf16["buckets"])
        assert bf16["wire"] == ["bfloat16"] * len(bf16["buckets"])
        assert bf16["events"] == [] and bf16["codec_fallbacks"] == 0
        assert all(not f[3] for fbs in bf16["fallbacks"].values() for f in fbs)
        assert all("fallbacks" not in s for s in bf16["summaries"])
        # compressed for real (not bitwise the fp32 result), and off by no more than bf16's
        # 8-bit mantissa allows: each gradient (so each SGD update) rounds by <= 2**-8 of
        # itself; the bound leaves room for the rounded sum of the two ranks' shares
        initial = _params(build("mlp"))
        diff = _max_diff(bf16["params"], plain["params"])
        moved = _max_diff(plain["params"], initial)
        assert 0 < diff <= 2**-6 * moved, (diff, moved)


# -- ZeRO-3 primitives reduce_scatter / all_gather -> all_reduce -----------------------
ZERO3_CONFIGS: dict[str, dict[str, Any]] = {
    "native": {"collectives": "native"},
    "no_reduce_scatter": {"collectives": "native", "disable_collectives": ("reduce_scatter",)},
    "no_all_gather": {"collectives": "native", "disable_collectives": ("all_gather",)},
    "backend_lacks_both": {"collectives": "native"},
    "auto": {"collectives": "auto"},
    "from_env": {"collectives": "native"},  # run under $LAMINA_DISABLE_COLLECTIVES
}
ALTERNATIVES = {
    "reduce_scatter": "all_reduce + slice",
    "all_gather": "all_reduce of a zero-filled buffer",
}
REPLACEABLE_OPS = ("all_gather", "reduce_scatter")
DISABLED = "{op} disabled by configuration (LAMINA_DISABLE_COLLECTIVES)"


def _zero3_run(name: str, runtime: Any) -> dict[str, Any]:
    saved = runtime.backend.unsupported_collectives
    if name == "backend_lacks_both":  # what a backend plugin declares for its vendor library
        runtime.backend.unsupported_collectives = frozenset({"reduce_scatter", "all_gather"})
    try:
        wrapped = lamina.distribute(build("mlp"), "zero3", min_unit_numel=0, **ZERO3_CONFIGS[name])
    finally:
        runtime.backend.unsupported_collectives = saved
    summaries = _train_mlp(wrapped, runtime.rank)
    plan = wrapped.execution_plan
    full: dict[str, torch.Tensor] = {}
    for state in wrapped.engine.units:
        views = state.layout.views(state.gather_master())
        full.update({k: v.detach().clone() for k, v in views.items()})
    steps = [n for n in plan.collectives() if n.phase != "setup"]
    return {
        "ops": {n.id: n.collective.op for n in steps},
        "primitives": {n.id: n.attr("primitive") for n in steps},
        "fallbacks": [
            (f.node, f.primary, f.alternative, f.when, f.taken, f.reason) for f in plan.fallbacks
        ],
        "engine": sorted({(u.primitive, u.scatter_primitive) for u in wrapped.engine.units}),
        "summary": summaries[-1],
        "issued": dict(wrapped.run_log.current.issued),
        "params": [full[n].flatten().tolist() for n, _ in build("mlp").named_parameters()],
    }


def _zero3_job(names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    runtime = lamina.init()
    return {name: _zero3_run(name, runtime) for name in names}


@pytest.fixture(scope="module")
def zero3_results() -> list[dict[str, dict[str, Any]]]:
    names = tuple(n for n in ZERO3_CONFIGS if n != "from_env")
    return run_ranks(_zero3_job, WORLD, args=(names,), env=CLEAN_ENV, timeout=100)


def _check_primitives(
    run: dict[str, Any], native: dict[str, Any], replaced: set[str], reason: str
) -> None:
    """``run`` issues all_reduce for the ``replaced`` ops (``reason``), the others
    natively, runs every planned node, and trains to the native run's parameters."""
    assert run["ops"].keys() == native["ops"].keys()
    requested = {
        n: "reduce_scatter" if n.endswith(".reduce_scatter") else "all_gather"
        for n in native["ops"]
    }
    assert native["ops"] == requested
    assert sum(op == "reduce_scatter" for op in requested.values()) == 4  # one unit per layer
    for node, op in requested.items():
        expected = "all_reduce" if op in replaced else op
        assert run["ops"][node] == run["primitives"][node] == expected, node
    assert {f[0] for f in run["fallbacks"]} == set(requested)  # one declared per node
    for node, primary, alternative, when, taken, why in run["fallbacks"]:
        assert (primary, alternative, when) == (requested[node], ALTERNATIVES[primary], "plan")
        assert taken == (primary in replaced), node
        assert why == (reason.format(op=primary) if taken else ""), node
    for op in sorted(replaced):
        count = sum(1 for o in requested.values() if o == op)
        assert f"{op} -> {ALTERNATIVES[op]} (x{count})" in run["summary"], run["summary"]
    gather, scatter = ("all_reduce" if op in replaced else "native" for op in REPLACEABLE_OPS)
    assert run["engine"] == [(gather, scatter)]  # the engine runs what the plan says
    assert run["issued"].keys() == run["ops"].keys(), run["issued"]  # every node, last step
    torch.testing.assert_close(_tensors(run["params"]), _tensors(native["params"]), rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_zero3_native_plan_takes_no_fallback(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in zero3_results:
        native = result["native"]
        _check_primitives(native, native, set(), "")
        assert "plan fallbacks" not in native["summary"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_disabled_reduce_scatter_becomes_all_reduce_and_slice(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in zero3_results:
        _check_primitives(
            result["no_reduce_scatter"], result["native"], {"reduce_scatter"}, DISABLED
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_disabled_all_gather_becomes_all_reduce_of_a_zero_filled_buffer(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in zero3_results:
        _check_primitives(result["no_all_gather"], result["native"], {"all_gather"}, DISABLED)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collectives_the_backend_lacks_or_auto_mode_use_their_all_reduce_forms(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    both = set(REPLACEABLE_OPS)
    for result in zero3_results:
        lacks = "the gloo process group lacks {op}"
        _check_primitives(result["backend_lacks_both"], result["native"], both, lacks)
        faster = "gloo: all_reduce is faster than {op} (64 MB, 2 ranks: ~75 vs ~140 ms)"
        _check_primitives(result["auto"], result["native"], both, faster)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collectives_disabled_through_the_environment(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    env = {**CLEAN_ENV, "LAMINA_DISABLE_COLLECTIVES": "reduce_scatter, all_gather"}
    results = run_ranks(_zero3_job, WORLD, args=(("from_env",),), env=env, timeout=100)
    for result, primary in zip(results, zero3_results, strict=True):
        _check_primitives(result["from_env"], primary["native"], set(REPLACEABLE_OPS), DISABLED)
