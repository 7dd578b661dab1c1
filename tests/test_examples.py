"""The portable examples train for real on gloo ranks: the MLP and the GPT example under
torchrun, as a user starts them; the GPT example's other strategies on the test harness's
ranks (``examples_on_ranks.py``: torchrun's environment, torch already imported)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples_on_ranks import run_example
from topologies_for_tests import two_hosts_of_two

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


TINY_CORPUS = ("--corpus-mb", "0.1", "--d-model", "32", "--n-layers", "1")


def torchrun(
    script: str,
    *args: str,
    ranks: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 100,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone`` on ``examples/<script>``."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(EXAMPLES / script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_train_mlp_loss_falls_on_two_ranks() -> None:
    result = torchrun("train_mlp.py", "--steps", "60", "--log-every", "20")
    assert result.returncode == 0, result.stderr[-3000:]
    done = re.search(
        r"done: 60 steps on 2 rank\(s\) \(cpu\) \| loss ([\d.]+) -> ([\d.]+)", result.stdout
    )
    assert done, result.stdout
    first, last = map(float, done.groups())
    assert last < first / 4, result.stdout
    assert len(re.findall(r"^step +\d+/60 +loss", result.stdout, re.M)) == 4


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_train_gpt_loss_falls_and_reports_validation() -> None:
    tiny = ["--max-steps", "20", "--batch-size", "8", "--seq-len", "64", "--d-model", "64"]
    tiny += ["--n-layers", "2", "--n-heads", "4", "--eval-every", "10", "--eval-batches", "2"]
    result = torchrun("train_gpt.py", *tiny, "--corpus-mb", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"corpus: \d+ stdlib files, [\d,]+ train / [\d,]+ val chars", out), out
    assert "2 rank(s) on cpu" in out
    evals = re.findall(r"step +(\d+)/20 \| train loss ([\d.]+) \| val loss ([\d.]+)", out)
    assert [step for step, _, _ in evals] == ["10", "20"], out
    done = re.search(r"done: 20 steps \| train loss ([\d.]+) -> ([\d.]+) \| val loss ([\d.]+)", out)
    assert done, out
    first, last, val = map(float, done.groups())
    assert last < first - 1.0, out  # from ~ln(vocab) towards the character frequencies
    assert val == float(evals[-1][2]) and val < first


@pytest.mark.multiprocess
@pytest.mark.timeout(400)  # over 3x the 100-s run a loaded 2-core machine measured
def test_train_gpt_compiled_under_tp_x_zero3_clips_in_its_graph_and_loss_falls() -> None:
    """``--compile step --tp 2`` with the default ``--grad-clip 1.0``: tensor parallelism's
    collectives, zero3's, the gradient norm and AdamW's update as one graph (aot_eager:
    the capture without Inductor's code generation), the LR schedule included, an
    evaluation between steps recompiling nothing."""
    tiny = ["--max-steps", "12", "--batch-size", "8", "--seq-len", "64", "--d-model", "64"]
    tiny += ["--n-layers", "2", "--n-heads", "4", "--eval-every", "6", "--eval-batches", "2"]
    tiny += ["--compile", "step", "--compile-backend", "aot_eager"]
    result = run_example(
        "train_gpt.py", *tiny, "--corpus-mb", "1", "--strategy", "zero3", "--tp", "2", timeout=360
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]  # the scheduler saw a step
    done = re.search(r"done: 12 steps \| train loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert done, result.stdout
    first, last = map(float, done.groups())
    assert last < first - 0.5, result.stdout
    line = re.search(
        r"compiled step: one graph per rank, compiled in [\d.]+ s \| last gradient "
        r"norm ([\d.]+) \(clipped in it\)",
        result.stdout,
    )
    assert line, result.stdout  # not the eager fallback, and clipping at 1.0
    assert float(line.group(1)) > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_train_gpt_with_zero3_loss_falls() -> None:
    tiny = ["--max-steps", "20", "--batch-size", "8", "--seq-len", "64", "--d-model", "64"]
    tiny += ["--n-layers", "2", "--n-heads", "4", "--eval-every", "10", "--eval-batches", "2"]
    result = run_example("train_gpt.py", *tiny, "--corpus-mb", "1", "--strategy", "zero3")
    assert result.returncode == 0, result.stderr[-3000:]
    done = re.search(r"done: 20 steps \| train loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert done, result.stdout
    first, last = map(float, done.groups())
    assert last < first - 1.0, result.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_train_gpt_pipelined_with_1f1b_and_zero3_stages_loss_falls_and_prints_the_cut() -> None:
    """pp=2 x zero3=2: each stage sharded over the two pipelines' ranks."""
    tiny = ["--max-steps", "12", "--batch-size", "4", "--seq-len", "32", "--d-model", "32"]
    tiny += ["--n-layers", "2", "--n-heads", "2", "--eval-every", "6", "--eval-batches", "1"]
    pipelined = ["--strategy", "pp", "--pp", "2", "--pp-schedule", "1f1b", "--pp-shard", "zero3"]
    result = run_example("train_gpt.py", *tiny, "--corpus-mb", "0.5", *pipelined, ranks=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pipeline: 1f1b, 2 stage(s) on 2 rank(s) x 2 pipeline(s)" in result.stdout, result.stdout
    assert "stage 1 (pipeline rank 1): blocks.1..blocks.1 + suffix" in result.stdout
    done = re.search(r"done: 12 steps \| train loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert done, result.stdout
    first, last = map(float, done.groups())
    assert last < first - 1.0, result.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_train_gpt_with_hsdp_on_two_hosts_of_two_loss_falls(tmp_path: Path) -> None:
    topology = two_hosts_of_two()
    path = tmp_path / "two_hosts.json"
    path.write_text(json.dumps(topology))
    tiny = ["--max-steps", "12", "--batch-size", "4", "--seq-len", "32", "--d-model", "32"]
    tiny += ["--n-layers", "2", "--n-heads", "2", "--eval-every", "6", "--eval-batches", "1"]
    result = run_example(
        "train_gpt.py",
        *tiny,
        "--corpus-mb",
        "0.5",
        "--strategy",
        "hsdp",
        ranks=4,
        env={"LAMINA_TOPOLOGY": str(path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pre-flight verification: 4 ranks agree" in result.stdout, result.stdout
    done = re.search(r"done: 12 steps \| train loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert done, result.stdout
    first, last = map(float, done.groups())
    assert last < first - 0.5, result.stdout
