"""Every declared fallback edge of the execution plan: forced, recorded, and still correct.

Each test forces one trigger on 2 real ranks and checks three things: the plan (plan-time
edges) or the run log and ``step_summary()`` (run-time edges) say which alternative ran
and why; and training on the alternative ends with the parameters the primary path
gives, while the primary path itself is compared with an independent reference (torch
DDP from the same start). Every rank builds its model from its own seed, so the runs
agree only through the wrap-time broadcasts of rank 0's state. Spawning ranks is the slow
part, so one module-scoped job runs every configuration (capture, compile, codec, ZeRO-3
primitives, the environment variable included); the tests, one per edge and trigger,
assert on their results.

Every fallback condition the code declares, and the test that triggers it:

- ``forward`` capture:export -> capture:fx, export raises:
  ``test_export_falls_back_to_fx_and_trains_like_ddp``
- ``forward`` capture:fx -> capture:hooks, fx raises:
  ``test_fx_falls_back_to_hooks_and_trains_like_ddp``
- ``forward`` compiled -> eager (run), compiling raises on the first call:
  ``test_compile_failure_falls_back_to_eager_with_the_same_parameters``; running the
  compiled forward raises on a later call:
  ``test_compiled_forward_failing_on_a_later_call_falls_back_from_that_step``
- bucket codec -> uncompressed (plan), the self-check raises:
  ``test_codec_failing_its_self_check_is_replaced_by_the_uncompressed_all_reduce``; it
  encodes the probe wrongly: ``test_codec_encoding_a_bucket_wrongly_is_replaced_by_...``;
  its round trip exceeds its tolerance: ``test_codec_exceeding_its_tolerance_is_...``
- bucket codec -> uncompressed (run), the reduction is not finite:
  ``test_fp16_overflow_is_resent_uncompressed_with_the_same_parameters``
- ZeRO-3 reduce_scatter / all_gather -> all-reduce forms (plan), disabled by
  ``disable_collectives``: ``test_disabled_reduce_scatter_becomes_all_reduce_and_slice``,
  ``test_disabled_all_gather_becomes_all_reduce_of_a_zero_filled_buffer``; by
  ``$LAMINA_DISABLE_COLLECTIVES``: ``test_collectives_disabled_through_the_environment``;
  missing on the backend, or ``collectives="auto"`` on gloo:
  ``test_collectives_the_backend_lacks_or_auto_mode_use_their_all_reduce_forms``;
  ``collectives="all_reduce"``: ``test_all_reduce_mode_uses_the_all_reduce_forms``
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lamina
from lamina.comm.codecs import Codec
from lamina.runtime import Compute
from lamina.runtime.primitives import DISABLE_ENV
from lamina.testing import run_ranks
from models_for_tests import MLP, NeedsFx, NeedsHooks, batch, build, full_params, loss_of

pytestmark = pytest.mark.portable

STEPS = 3
WORLD = 2
#: Every job starts from a clean lamina configuration, whatever the calling shell sets.
CLEAN_ENV = {
    "LAMINA_BACKEND": "cpu",
    "LAMINA_DISABLE_COLLECTIVES": "",
}
#: Small bucket caps: the MLP's gradients land in several buckets, each with its node.
SMALL_BUCKETS: dict[str, Any] = {"bucket_cap_mb": 0.004, "first_bucket_mb": 0.001}
#: fp16 tops out at 65504; gradients of a loss scaled by 2**30 are far past that, while
#: bf16 (fp32's exponent range) carries them. SGD's step is scaled down by as much.
LOSS_SCALE = 2.0**30
#: Every run trains with plain SGD: its step is proportional to the gradient, so a wrongly
#: scaled average shows in the parameters (AdamW's update hardly depends on the scale).
SGD_LR = 0.1
#: lamina (DP or ZeRO-3) and DDP from the same start: both average two ranks' fp32 shares
#: (one rounded addition each), so they agree to a few float32 ulps (2**-23) after the
#: steps; a wrongly scaled average moves SGD's parameters by ~0.1 x the gradient.
DDP_TOLERANCE = 1e-6
#: A torch.compile backend whose compiled forward raises on its second call.
FLAKY_BACKEND = "lamina_test_fails_on_second_call"


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


class HalfSizeCodec(BrokenCodec):
    """A user codec whose wire tensor holds half of the bucket: "encoded wrongly"."""

    name = "half"

    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        self.encode_calls += 1
        return bucket[: bucket.numel() // 2].to(self.wire_dtype)


class ZerosCodec(BrokenCodec):
    """A user codec that sends zeros: a round-trip error of 100%, past its tolerance."""

    name = "zeros"

    def encode(self, bucket: torch.Tensor) -> torch.Tensor:
        self.encode_calls += 1
        return torch.zeros_like(bucket, dtype=self.wire_dtype)


#: The codecs failing their self-check, and the reason each must record.
FAILING_CODECS: dict[str, tuple[Callable[[], BrokenCodec], str]] = {
    "broken": (
        BrokenCodec,
        "codec broken failed its self-check: RuntimeError: encoder unavailable on this device",
    ),
    # the self-check's probe bucket: 1031 values from -4 to 4
    "half": (HalfSizeCodec, "codec half encoded a 1031-element bucket wrongly"),
    # every nonzero probe value is above the check's 1e-3 floor, so zeros are off by
    # exactly 100% of each
    "zeros": (ZerosCodec, "codec zeros round-trip error 1.00e+00 exceeds its tolerance 1.00e-03"),
}


def _fails_on_second_call(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """A compile backend that compiles, runs the graph once, then raises on the next call
    (a compiled kernel that fails at run time, after the first step)."""
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("compiled kernel failed on its second call")
        return gm.forward(*args)

    return run


def _register_flaky_backend() -> None:
    if FLAKY_BACKEND not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_fails_on_second_call, name=FLAKY_BACKEND)


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


def _train_mlp(model: nn.Module, rank: int, *, scale: float = 1.0) -> list[str]:
    """STEPS SGD steps on the tests' MLP batches, the loss multiplied by ``scale`` (and the
    learning rate divided by it); the step summary after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR / scale)
    summaries = []
    for step in range(STEPS):
        x, y = batch("mlp", step, rank)
        (loss_of("mlp", model(x), y) * scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        summary = getattr(model, "step_summary", None)
        summaries.append(summary() if summary is not None else "")
    return summaries


def _ddp_params(rank: int, *, scale: float = 1.0) -> list[list[float]]:
    """The independent reference: torch DDP trained as :func:`_train_mlp` trains lamina,
    from this rank's own initial weights (DDP broadcasts rank 0's at construction)."""
    ddp = DDP(build("mlp", seed=rank))
    _train_mlp(ddp, rank, scale=scale)
    return _params(ddp.module)


# -- one spawned job for every edge ------------------------------------------------------
Results = dict[str, dict[str, dict[str, Any]]]


def _job() -> Results:
    """Every configuration on this rank: capture, compile, codec and ZeRO-3 families."""
    runtime = lamina.init()
    rank = runtime.rank
    ddp = {"params": _ddp_params(rank)}  # trained as the compile and ZeRO-3 runs are
    zero3 = {name: _zero3_run(name, runtime) for name in ZERO3_CONFIGS}
    return {
        "capture": _capture_job(rank),
        "compile": {**_compile_job(rank), "ddp": ddp},
        "codec": _codec_job(rank),
        "zero3": {**zero3, "ddp": ddp},
    }


@pytest.fixture(scope="module")
def results() -> list[Results]:
    return run_ranks(_job, WORLD, env=CLEAN_ENV, timeout=200)


# -- capture export -> fx -> hooks ----------------------------------------------------
def _capture_job(rank: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    models = {"fx": lambda: NeedsFx(8, 16, 8), "hooks": lambda: NeedsHooks(8, 8)}
    for name, make in models.items():
        torch.manual_seed(rank)  # ranks start apart: only the broadcasts align them
        initial = make()
        example = _small_batch(0, rank)[0]
        ours = lamina.distribute(copy.deepcopy(initial), "dp", example_inputs=(example,))
        ddp = DDP(copy.deepcopy(initial))
        for model in (ours, ddp):
            opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
            for step in range(STEPS):
                x, y = _small_batch(step, rank)
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        plan = ours.execution_plan
        out[name] = {
            "method": ours.graph.method,
            "capture_attr": plan.node("forward").facts(Compute).capture,
            "fallbacks": _fallbacks(plan, "forward"),
            "summary": ours.step_summary(),
            "events": list(ours.run_log.events),
            "ours": _params(ours.module),
            "ddp": _params(ddp.module),
        }
    return out


@pytest.fixture(scope="module")
def capture_results(results: list[Results]) -> list[dict[str, dict[str, Any]]]:
    return [r["capture"] for r in results]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
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
        torch.testing.assert_close(
            _tensors(fx["ours"]), _tensors(fx["ddp"]), rtol=0, atol=DDP_TOLERANCE
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
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
            _tensors(hooks["ours"]), _tensors(hooks["ddp"]), rtol=0, atol=DDP_TOLERANCE
        )
    # the ranks hold the same model, although the branch went different ways on them
    assert capture_results[0]["hooks"]["ours"] == capture_results[1]["hooks"]["ours"]


# -- compiled forward -> eager --------------------------------------------------------
def _compile_job(rank: int) -> dict[str, dict[str, Any]]:
    _register_flaky_backend()
    out: dict[str, dict[str, Any]] = {}
    for name, model, compile_ in (
        ("eager", build("mlp", seed=rank), False),
        ("compiled", build("mlp", seed=rank), "eager"),
        ("breaks", _built(BreaksCompile, seed=rank), "eager"),
        ("flaky", build("mlp", seed=rank), FLAKY_BACKEND),
    ):
        wrapped = lamina.distribute(model, "dp", compile=compile_, **SMALL_BUCKETS)
        summaries = _train_mlp(wrapped, rank)
        plan = wrapped.execution_plan
        out[name] = {
            "summaries": summaries,
            "events": list(wrapped.run_log.events),
            "fallbacks": _fallbacks(plan, "forward"),
            "mode": plan.node("forward").facts(Compute).mode,
            "failed": compiled.failed if (compiled := wrapped.lamina_dp.compiled) else None,
            "params": _params(wrapped.module),
        }
    return out


def _built(cls: type[nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


@pytest.fixture(scope="module")
def compile_results(results: list[Results]) -> list[dict[str, dict[str, Any]]]:
    return [r["compile"] for r in results]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
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
        # and never compiling trains as DDP does
        torch.testing.assert_close(
            _tensors(eager["params"]), _tensors(result["ddp"]["params"]), rtol=0, atol=DDP_TOLERANCE
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_compiled_forward_failing_on_a_later_call_falls_back_from_that_step(
    compile_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in compile_results:
        flaky, eager = result["flaky"], result["eager"]
        assert flaky["mode"] == f"compiled:{FLAKY_BACKEND}" and flaky["failed"] is True
        (event,) = flaky["events"]  # step 1 ran compiled; step 2's call raised
        assert (event.step, event.node, event.primary, event.alternative) == (
            2,
            "forward",
            f"compiled:{FLAKY_BACKEND}",
            "eager",
        )
        assert event.reason == "RuntimeError: compiled kernel failed on its second call"
        assert "run fallbacks" not in flaky["summaries"][0]
        assert f"run fallbacks: forward compiled:{FLAKY_BACKEND} -> eager" in flaky["summaries"][1]
        assert "run fallbacks" not in flaky["summaries"][2]
        # the call that raised ran nothing; the compiled step 1 computed what eager does
        torch.testing.assert_close(
            _tensors(flaky["params"]), _tensors(eager["params"]), rtol=0, atol=DDP_TOLERANCE
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
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
            _tensors(compiled["params"]), _tensors(eager["params"]), rtol=0, atol=DDP_TOLERANCE
        )


# -- codecs -> uncompressed -------------------------------------------------------------
def _codec_job(rank: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"ddp": {"params": _ddp_params(rank, scale=LOSS_SCALE)}}
    for name in ("none", *FAILING_CODECS, "fp16", "bf16"):
        codec: str | Codec | None = None if name == "none" else name
        if name in FAILING_CODECS:
            codec = FAILING_CODECS[name][0]()
        wrapped = lamina.distribute(build("mlp", seed=rank), "dp", codec=codec, **SMALL_BUCKETS)
        summaries = _train_mlp(wrapped, rank, scale=LOSS_SCALE)
        plan = wrapped.execution_plan
        buckets = [n for n in plan.collectives() if n.id.startswith("bucket")]
        out[name] = {
            "buckets": [n.id for n in buckets],
            "codec_attr": [n.codec.name if n.codec else "none" for n in buckets],
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
def codec_results(results: list[Results]) -> list[dict[str, dict[str, Any]]]:
    return [r["codec"] for r in results]


def _check_self_check_fallback(result: dict[str, dict[str, Any]], name: str) -> None:
    """Codec ``name`` failed its self-check with its reason; every bucket ran uncompressed
    and trained to the uncompressed run's parameters, which are DDP's."""
    failed, plain = result[name], result["none"]
    assert len(failed["buckets"]) >= 2 and failed["buckets"] == plain["buckets"]
    assert failed["codec_attr"] == ["none"] * len(failed["buckets"])
    assert failed["wire"] == [None] * len(failed["buckets"])
    for node, fallbacks in failed["fallbacks"].items():
        # taken while planning; no run-time overflow check for a codec that is not used
        ((primary, alternative, when, taken, reason),) = fallbacks
        assert (primary, alternative, when, taken) == (
            f"codec:{name}",
            "uncompressed",
            "plan",
            True,
        ), node
        assert reason == FAILING_CODECS[name][1]
    assert failed["encode_calls"] == 1  # the self-check only; training never encodes
    assert failed["events"] == [] and failed["codec_fallbacks"] == 0
    taken = f"plan fallbacks: codec:{name} -> uncompressed (x{len(failed['buckets'])})"
    assert taken in failed["summaries"][-1]
    torch.testing.assert_close(
        _tensors(failed["params"]), _tensors(plain["params"]), rtol=0, atol=0
    )
    torch.testing.assert_close(
        _tensors(plain["params"]), _tensors(result["ddp"]["params"]), rtol=0, atol=DDP_TOLERANCE
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_codec_failing_its_self_check_is_replaced_by_the_uncompressed_all_reduce(
    codec_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in codec_results:
        _check_self_check_fallback(result, "broken")  # the encoder raises


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_codec_encoding_a_bucket_wrongly_is_replaced_by_the_uncompressed_all_reduce(
    codec_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in codec_results:
        _check_self_check_fallback(result, "half")  # a wire tensor of the wrong size


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_codec_exceeding_its_tolerance_is_replaced_by_the_uncompressed_all_reduce(
    codec_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in codec_results:
        _check_self_check_fallback(result, "zeros")  # decodes to zeros: 100% error


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
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
@pytest.mark.timeout(240)
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
        initial = _params(build("mlp", seed=0))  # rank 0's, which every rank starts from
        diff = _max_diff(bf16["params"], plain["params"])
        moved = _max_diff(plain["params"], initial)
        assert 0 < diff <= 2**-6 * moved, (diff, moved)


# -- ZeRO-3 primitives reduce_scatter / all_gather -> all_reduce -----------------------
ZERO3_CONFIGS: dict[str, dict[str, Any]] = {
    "native": {"collectives": "native"},
    "all_reduce": {"collectives": "all_reduce"},
    "no_reduce_scatter": {"collectives": "native", "disable_collectives": ("reduce_scatter",)},
    "no_all_gather": {"collectives": "native", "disable_collectives": ("all_gather",)},
    "backend_lacks_both": {"collectives": "native"},
    "auto": {"collectives": "auto"},
    "from_env": {"collectives": "native"},  # run under $LAMINA_DISABLE_COLLECTIVES
}
#: What each form does in place of the requested op (the plan's declared alternative).
ALTERNATIVES = {
    ("reduce_scatter", "all_reduce"): "all_reduce + slice",
    ("all_gather", "all_reduce"): "all_reduce of a zero-filled buffer",
    ("reduce_scatter", "all_to_all"): "all_to_all + local sum",
    ("all_gather", "broadcast"): "one broadcast per rank",
}
#: The engine's name of each op the plan issues.
ENGINE_PRIMITIVE = {
    "all_gather": "native",
    "reduce_scatter": "native",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all",
}
#: The all-reduce forms (every backend), and gloo's faster forms (``collectives="auto"``).
ALL_REDUCE_FORMS = {"all_gather": "all_reduce", "reduce_scatter": "all_reduce"}
GLOO_FORMS = {"all_gather": "broadcast", "reduce_scatter": "all_to_all"}
REPLACEABLE_OPS = ("all_gather", "reduce_scatter")
DISABLED = "{op} disabled by configuration (LAMINA_DISABLE_COLLECTIVES)"


def _zero3_run(name: str, runtime: Any) -> dict[str, Any]:
    saved = runtime.backend.unsupported_collectives
    if name == "backend_lacks_both":  # what a backend plugin declares for its vendor library
        runtime.backend.unsupported_collectives = frozenset({"reduce_scatter", "all_gather"})
    if name == "from_env":  # read while planning, as a launcher would set it
        os.environ[DISABLE_ENV] = "reduce_scatter, all_gather"
    try:
        wrapped = lamina.distribute(
            build("mlp", seed=runtime.rank), "zero3", min_unit_numel=0, **ZERO3_CONFIGS[name]
        )
    finally:
        runtime.backend.unsupported_collectives = saved
        os.environ[DISABLE_ENV] = ""  # CLEAN_ENV's value
    summaries = _train_mlp(wrapped, runtime.rank)
    plan = wrapped.execution_plan
    full = full_params(wrapped)
    steps = [n for n in plan.collectives() if n.phase != "setup"]
    return {
        "ops": {n.id: n.collective.op for n in steps},
        "primitives": {n.id: n.detail.primitive for n in steps},
        "fallbacks": [
            (f.node, f.primary, f.alternative, f.when, f.taken, f.reason) for f in plan.fallbacks
        ],
        "engine": sorted({(u.primitive, u.scatter_primitive) for u in wrapped.lamina_engine.units}),
        "summary": summaries[-1],
        "issued": dict(wrapped.run_log.current.issued),
        "params": [full[n].flatten().tolist() for n, _ in build("mlp").named_parameters()],
    }


@pytest.fixture(scope="module")
def zero3_results(results: list[Results]) -> list[dict[str, dict[str, Any]]]:
    return [r["zero3"] for r in results]


def _check_primitives(
    run: dict[str, Any],
    native: dict[str, Any],
    replaced: set[str],
    reason: str | dict[str, str],
    forms: dict[str, str] = ALL_REDUCE_FORMS,
) -> None:
    """``run`` issues ``forms[op]`` for the ``replaced`` ops (``reason``), the others
    natively, runs every planned node, and trains to the native run's parameters (which
    ``test_zero3_native_plan_takes_no_fallback`` compares with DDP's)."""
    _check_plan(run, native, replaced, reason, forms)
    torch.testing.assert_close(_tensors(run["params"]), _tensors(native["params"]), rtol=0, atol=0)


def _check_plan(
    run: dict[str, Any],
    native: dict[str, Any],
    replaced: set[str],
    reason: str | dict[str, str],
    forms: dict[str, str] = ALL_REDUCE_FORMS,
) -> None:
    """The plan, engine and run log of ``run``: ``forms[op]`` for the ``replaced`` ops."""
    assert run["ops"].keys() == native["ops"].keys()
    requested = {
        n: "reduce_scatter" if n.endswith(".reduce_scatter") else "all_gather"
        for n in native["ops"]
    }
    assert native["ops"] == requested
    assert sum(op == "reduce_scatter" for op in requested.values()) == 4  # one unit per layer
    issues = {op: forms[op] if op in replaced else op for op in REPLACEABLE_OPS}
    for node, op in requested.items():
        assert run["ops"][node] == run["primitives"][node] == issues[op], node
    assert {f[0] for f in run["fallbacks"]} == set(requested)  # one declared per node
    for node, primary, alternative, when, taken, why in run["fallbacks"]:
        declared = ALTERNATIVES[primary, forms[primary]]
        assert (primary, alternative, when) == (requested[node], declared, "plan")
        assert taken == (primary in replaced), node
        said = reason[primary] if isinstance(reason, dict) else reason.format(op=primary)
        assert why == (said if taken else ""), node
    for op in sorted(replaced):
        count = sum(1 for o in requested.values() if o == op)
        summary = f"{op} -> {ALTERNATIVES[op, forms[op]]} (x{count})"
        assert summary in run["summary"], run["summary"]
    gather, scatter = (ENGINE_PRIMITIVE[issues[op]] for op in REPLACEABLE_OPS)
    assert run["engine"] == [(gather, scatter)]  # the engine runs what the plan says
    assert run["issued"].keys() == run["ops"].keys(), run["issued"]  # every node, last step


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_zero3_native_plan_takes_no_fallback(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in zero3_results:
        native = result["native"]
        _check_plan(native, native, set(), "")
        assert "plan fallbacks" not in native["summary"]
        # the primary path against the independent reference (every fallback run is
        # compared with this one): ZeRO-3's reduce-scatter mean against DDP's all-reduce
        # mean of the same two fp32 shares
        torch.testing.assert_close(
            _tensors(native["params"]),
            _tensors(result["ddp"]["params"]),
            rtol=0,
            atol=DDP_TOLERANCE,
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_disabled_reduce_scatter_becomes_all_reduce_and_slice(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in zero3_results:
        _check_primitives(
            result["no_reduce_scatter"], result["native"], {"reduce_scatter"}, DISABLED
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_disabled_all_gather_becomes_all_reduce_of_a_zero_filled_buffer(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in zero3_results:
        _check_primitives(result["no_all_gather"], result["native"], {"all_gather"}, DISABLED)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_collectives_the_backend_lacks_use_their_all_reduce_forms(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    both = set(REPLACEABLE_OPS)
    for result in zero3_results:
        lacks = "the gloo process group lacks {op}"
        _check_primitives(result["backend_lacks_both"], result["native"], both, lacks)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_auto_mode_on_gloo_broadcasts_the_gather_and_all_to_alls_the_scatter(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    reasons = {
        "all_gather": "gloo: one broadcast per rank is faster than all_gather "
        "(16 MB, 2 ranks: ~8 vs ~11 ms)",
        "reduce_scatter": "gloo: all_to_all + local sum is faster than reduce_scatter "
        "(16 MB, 2 ranks: ~12 vs ~24 ms)",
    }
    for result in zero3_results:
        _check_primitives(
            result["auto"], result["native"], set(REPLACEABLE_OPS), reasons, GLOO_FORMS
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_all_reduce_mode_uses_the_all_reduce_forms(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    requested = "collectives='all_reduce' requested"
    for result in zero3_results:
        _check_primitives(result["all_reduce"], result["native"], set(REPLACEABLE_OPS), requested)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_collectives_disabled_through_the_environment(
    zero3_results: list[dict[str, dict[str, Any]]],
) -> None:
    for result in zero3_results:  # planned with $LAMINA_DISABLE_COLLECTIVES set
        _check_primitives(result["from_env"], result["native"], set(REPLACEABLE_OPS), DISABLED)
