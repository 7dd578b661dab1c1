"""Everything a GPU session checks, in one script: one JSON, one table.

Parts (each recorded with its outcome, so one failure does not hide the others):

- ``backend_tests``: the cuda backend's own suite (``pytest backends/cuda/tests``:
  conformance kit, Triton kernels, live NVML);
- ``training``: one rank, a GPT (~150M parameters on a GPU; a tiny one with ``--device
  cpu``) under the plain model, lamina DP, torch DDP, lamina ZeRO-3 and torch FSDP2, in
  fp32 and under bf16 autocast, plus bf16 mixed precision (ZeRO-3's ``param_dtype``
  against FSDP2's ``MixedPrecisionPolicy``), and compiled: ``lamina.compile_step`` on DP
  and ZeRO-3 (fp32 and autocast) against ``torch.compile`` under DDP and FSDP2 with
  ``torch.compile`` per block (Inductor; ``aot_eager`` with ``--device cpu``, where
  Inductor's C++ build would take minutes): median step time and peak device memory of
  each (a compiled variant's compile falls in its warm-up steps), and its ratio to the
  plain model (``--device cpu`` leaves out the autocast variants and FSDP2's bf16 parameters);
- ``shared_device``: the multi-rank tests that run two ranks on one device
  (``LAMINA_SHARE_DEVICE=1``, collectives on gloo): DP and ZeRO-3 against DDP, on the
  backend ``LAMINA_TEST_BACKEND`` names (the test configuration pins ``LAMINA_BACKEND``
  to cpu for every other test); they fail unless they ran on its device type;
- ``trace``: ``examples/train_gpt.py`` under ``LAMINA_TRACE``, whose report must count
  every step.

On a GPU machine::

    python benchmarks/gpu_suite.py        # writes results/gpu_<device name>.json

``--device cpu`` runs the same parts in a tiny version (the test command runs it, so
the script cannot rot); the backend suite is then skipped with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from _gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402
from _results import write_results  # noqa: E402

#: (d_model, layers, heads, vocab, seq, batch) of the training part's GPT.
SIZES = {"cuda": (768, 16, 12, 32768, 512, 8), "cpu": (64, 2, 2, 256, 32, 2)}
#: Training variants: (name, strategy or baseline, precision).
VARIANTS = (
    ("plain", "plain", "fp32"),
    ("dp", "dp", "fp32"),
    ("ddp", "ddp", "fp32"),
    ("zero3", "zero3", "fp32"),
    ("fsdp2", "fsdp2", "fp32"),
    ("plain_autocast", "plain", "autocast"),
    ("dp_autocast", "dp", "autocast"),
    ("ddp_autocast", "ddp", "autocast"),
    ("zero3_autocast", "zero3", "autocast"),
    ("fsdp2_autocast", "fsdp2", "autocast"),
    ("zero3_bf16_params", "zero3", "mixed"),
    ("fsdp2_bf16_params", "fsdp2", "mixed"),
    ("dp_step", "dp_step", "fp32"),
    ("zero3_step", "zero3_step", "fp32"),
    ("ddp_compiled", "ddp_compiled", "fp32"),
    ("fsdp2_compiled", "fsdp2_compiled", "fp32"),
    ("dp_step_autocast", "dp_step", "autocast"),
    ("zero3_step_autocast", "zero3_step", "autocast"),
)
#: The compiler backend of the compiled variants, per device.
COMPILE_BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}
#: Left out of the tiny CPU run: the same code as their fp32 forms, under autocast.
CPU_SKIPS = frozenset(
    {
        "dp_step_autocast",
        "zero3_step_autocast",
        # the same wrappers as their fp32 variants at another precision: on the CPU their
        # code paths are the fp32 ones plus torch's autocast (zero3_bf16_params stays, the
        # one variant whose parameters lamina itself keeps in bf16, with plain_autocast,
        # the baseline of its ratio)
        "dp_autocast",
        "ddp_autocast",
        "zero3_autocast",
        "fsdp2_autocast",
        "fsdp2_bf16_params",
    }
)
#: The shared-device tests (two ranks on one device).
SHARED_TESTS = ("tests/test_shared_device.py",)


def gpt(device: str) -> nn.Module:
    d, layers, heads, vocab, seq, _ = SIZES[device]
    return GPT(GPTConfig(vocab_size=vocab, seq_len=seq, d_model=d, n_layers=layers, n_heads=heads))


def wrap(strategy: str, precision: str, model: nn.Module) -> nn.Module:
    """``model`` under ``strategy`` (``plain``: as it is)."""
    import lamina

    if strategy == "plain":
        return model
    if strategy in ("dp", "dp_step"):
        return lamina.distribute(model, "dp")
    if strategy in ("ddp", "ddp_compiled"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        if strategy == "ddp":
            return ddp
        compiled: nn.Module = torch.compile(ddp, backend=COMPILE_BACKEND[_device_of(model)])  # type: ignore[assignment]
        return compiled
    if strategy == "zero3_step":
        return lamina.distribute(model, "zero3")
    if strategy == "zero3":
        dtype = torch.bfloat16 if precision == "mixed" else None
        return lamina.distribute(model, "zero3", param_dtype=dtype)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    runtime = lamina.current()
    assert runtime is not None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": runtime.mesh.torch_mesh}
    if precision == "mixed":
        kwargs["mp_policy"] = policy
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **kwargs)
        if strategy == "fsdp2_compiled":
            block.compile(backend=COMPILE_BACKEND[_device_of(model)])
    fully_shard(model, **kwargs)
    return model


def _device_of(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def time_variant(
    name: str, strategy: str, precision: str, device: str, steps: int
) -> dict[str, Any]:
    """Median step time and peak memory of one variant (built, warmed, timed, freed)."""
    import lamina

    runtime = lamina.current()
    assert runtime is not None
    handle = runtime.handle
    _, _, _, vocab, seq, batch = SIZES[device]
    torch.manual_seed(0)
    model = wrap(strategy, precision, gpt(device).to(runtime.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if precision == "autocast":

        def autocast() -> contextlib.AbstractContextManager[Any]:
            return torch.autocast(runtime.device.type, dtype=torch.bfloat16)

    captured = (
        lamina.compile_step(model, opt, lm_loss, backend=COMPILE_BACKEND[device])
        if strategy.endswith("_step")
        else None
    )
    times = []
    for step in range(steps + 2):  # 2 warm-up steps (ZeRO-3's step compiles at its second)
        if step == 2:
            handle.reset_peak_memory()
        gen = torch.Generator().manual_seed(step)
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(runtime.device)
        handle.synchronize()
        start = time.perf_counter()
        with autocast():
            if captured is not None:
                loss = captured(idx[:, :-1], idx[:, 1:])
            else:
                loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        if captured is None:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        handle.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
    peak = handle.memory_stats().peak
    del model, opt
    return {
        "name": name,
        "strategy": strategy,
        "precision": precision,
        "median_step_s": statistics.median(times),
        "peak_bytes": peak,
        "loss": float(loss.detach()),
    }


def training(device: str, steps: int) -> dict[str, Any]:
    """Every variant, one rank (``lamina.init`` on ``device``'s backend)."""
    import lamina

    with lamina.init(backend=device) as runtime:
        params = sum(p.numel() for p in gpt(device).parameters())
        rows = {}
        for name, strategy, precision in VARIANTS:
            if device == "cpu" and name in CPU_SKIPS:
                continue
            rows[name] = time_variant(name, strategy, precision, device, steps)
            print(f"  {name:20}{rows[name]['median_step_s'] * 1e3:10.1f} ms", flush=True)
        for row in rows.values():
            base = rows["plain_autocast" if row["precision"] != "fp32" else "plain"]
            row["time_over_plain"] = row["median_step_s"] / base["median_step_s"]
            if row["peak_bytes"] and base["peak_bytes"]:
                row["peak_over_plain"] = row["peak_bytes"] / base["peak_bytes"]
        return {"parameters": params, "device": str(runtime.device), "variants": rows}


def pytest_counts(output: str) -> dict[str, int]:
    """passed / failed / skipped / errors from pytest's last line."""
    counts = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", output):
        counts[word.rstrip("s") if word == "errors" else word] = int(number)
    return counts


def run_pytest(paths: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``pytest -q paths`` in a fresh process: its counts and exit status."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    return {
        "returncode": proc.returncode,
        "counts": pytest_counts(tail),
        "last_line": tail,
        "seconds": time.perf_counter() - started,
    }


def trace_run(device: str, steps: int) -> dict[str, Any]:
    """``train_gpt.py`` on one rank under ``LAMINA_TRACE``; the report's step count."""
    from lamina.trace.analysis import build_report
    from lamina.trace.events import read_dir

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "lamina.cli.main", "run", "--backend", device,
            str(ROOT / "examples" / "train_gpt.py"), "--max-steps", str(steps),
            "--eval-every", str(steps), "--eval-batches", "1", "--batch-size", "4",
            "--seq-len", "32", "--corpus-mb", "0.5",
        ]  # fmt: skip
        env = {**os.environ, "LAMINA_TRACE": tmp}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            return {"returncode": proc.returncode, "stderr": proc.stderr[-2000:]}
        report = build_report(read_dir(tmp), tmp)
    return {"returncode": 0, "steps_trained": steps, "steps_in_report": report.totals["steps"]}


@contextlib.contextmanager
def part(results: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    """Record part ``name``'s outcome (an exception is recorded, not raised)."""
    started = time.perf_counter()
    record: dict[str, Any] = {}
    print(f"== {name}", flush=True)
    try:
        yield record
        record.setdefault("outcome", "ok")
    except Exception as exc:  # recorded: the other parts still run
        record["outcome"] = f"failed: {type(exc).__name__}: {exc}"
    record["seconds"] = time.perf_counter() - started
    results[name] = record


def device_name(device: str) -> str:
    """A file-name form of the GPU's name (``cpu`` on the CPU)."""
    if device == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower()).strip("_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (cuda 10, cpu 2)")
    parser.add_argument("--output", default=None, help="results/gpu_<device name>.json")
    args = parser.parse_args()
    steps = args.steps or (10 if args.device == "cuda" else 2)
    results: dict[str, Any] = {"device": args.device, "name": device_name(args.device)}
    with part(results, "backend_tests") as record:
        if args.device == "cuda":
            record.update(run_pytest(["backends/cuda/tests"], {}, timeout=240))
            record["outcome"] = "ok" if record["returncode"] == 0 else "failed"
        else:
            record["outcome"] = "skipped: the cuda backend suite needs a GPU"
    with part(results, "training") as record:
        record.update(training(args.device, steps))
    with part(results, "shared_device") as record:
        env = {"LAMINA_SHARE_DEVICE": "1", "LAMINA_TEST_BACKEND": args.device}
        record["env"] = env
        record.update(run_pytest(list(SHARED_TESTS), env, timeout=240))
        record["outcome"] = "ok" if record["returncode"] == 0 else "failed"
    with part(results, "trace") as record:
        record.update(trace_run(args.device, steps=4))
        ok = record.get("steps_in_report") == record.get("steps_trained")
        record["outcome"] = "ok" if ok else "failed"
    print(f"{'part':16}{'outcome':40}{'seconds':>9}")
    for name in ("backend_tests", "training", "shared_device", "trace"):
        r = results[name]
        print(f"{name:16}{str(r['outcome'])[:40]:40}{r['seconds']:9.1f}")
    rows = results["training"].get("variants", {})
    if rows:
        print(f"{'variant':20}{'step ms':>10}{'vs plain':>10}{'peak MiB':>10}")
        for name, row in rows.items():
            peak = f"{row['peak_bytes'] / 2**20:.0f}" if row["peak_bytes"] else "-"
            print(
                f"{name:20}{row['median_step_s'] * 1e3:10.1f}{row['time_over_plain']:10.3f}"
                f"{peak:>10}"
            )
    output = args.output or f"gpu_{results['name']}.json"
    write_results("gpu_suite", output, results)
    failed = [n for n in ("backend_tests", "training", "shared_device", "trace")
              if str(results[n]["outcome"]).startswith("failed")]  # fmt: skip
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({n: results[n]["outcome"] for n in results if isinstance(results[n], dict)}))


if __name__ == "__main__":
    main()
