"""CheckpointManager: atomic commits, checks before any tensor is read, resume on another
world size (in-process ranks), and exact resume of the GPT example after kill -9."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lamina
from files_for_tests import flip_byte
from lamina.checkpoint import CheckpointManager
from lamina.errors import ConfigError
from lamina.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _model(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def _wrap(strategy: str, model: nn.Module) -> nn.Module:
    if strategy == "dp":
        return lamina.distribute(model, "dp", example_inputs=(torch.zeros(2, 16),))
    return lamina.distribute(model, strategy)


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full (unsharded) model and optimizer state, as plain CPU tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    flat = {f"model.{k}": v for k, v in model_state.items()}
    for name, state in optim_state["state"].items():
        for key, value in state.items():
            flat[f"optim.{name}.{key}"] = value
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in flat.items()}


def _train_and_save(strategy: str, directory: str) -> dict[str, Any]:
    runtime = lamina.init()
    model = _wrap(strategy, _model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(directory, keep=2)
    for step in range(1, 4):
        gen = torch.Generator().manual_seed(step * 10 + runtime.rank)
        model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save(step, model, optimizer, extra={"position": step * 8, "rank": runtime.rank})
    return {"state": _full_state(model, optimizer), "steps": manager.steps()}


def _load(strategy: str, directory: str) -> dict[str, Any]:
    lamina.init()
    model = _wrap(strategy, _model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(directory, keep=2)
    step = manager.load_latest(model, optimizer)
    return {"step": step, "extra": manager.extra, "state": _full_state(model, optimizer)}


def _load_error(directory: str, width: int = 16) -> str:
    lamina.init()
    model = lamina.distribute(
        nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4)),
        "dp",
        example_inputs=(torch.zeros(2, 16),),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        step = CheckpointManager(directory).load_latest(model, optimizer)
    except ConfigError as exc:
        return str(exc)
    return f"loaded step {step}"


def _build(strategy: str, directory: Path) -> Any:
    results = run_ranks(_train_and_save, 2, args=(strategy, str(directory)), timeout=180)
    return strategy, directory, results


@pytest.fixture(scope="module")
def dp_saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A DP checkpoint of 2 ranks (steps 2 and 3 kept)."""
    return _build("dp", tmp_path_factory.mktemp("ckpt-dp"))


@pytest.fixture(scope="module", params=["dp", "zero3"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A checkpoint of 2 ranks per strategy (the DP one is ``dp_saved``)."""
    if request.param == "dp":
        return request.getfixturevalue("dp_saved")
    return _build(request.param, tmp_path_factory.mktemp(f"ckpt-{request.param}"))


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(240)
def test_saves_commit_atomically_and_keep_the_last_two(saved: Any) -> None:
    _strategy, directory, results = saved
    assert results[0]["steps"] == [2, 3]
    assert sorted(p.name for p in directory.iterdir()) == ["step-2", "step-3"]
    names = {p.name for p in (directory / "step-3").iterdir()}
    assert {"manifest.json", ".metadata", "rank-0.pt", "rank-1.pt"} <= names


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_on_any_world_size_restores_the_saved_state(saved: Any, world: int) -> None:
    strategy, directory, results = saved
    loaded = run_ranks(_load, world, args=(strategy, str(directory)), timeout=180)
    for rank, result in enumerate(loaded):
        assert result["step"] == 3
        assert _equal(result["state"], results[0]["state"]), rank
        expected = {"position": 24, "rank": rank if rank < 2 else 0}
        assert result["extra"] == expected


@pytest.fixture
def copy_of(dp_saved: Any, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(dp_saved[1], target)
    return target


def _corrupt_and_load(directory: Path, change: Any) -> tuple[str, dict[str, bytes]]:
    step = directory / "step-3"
    change(step)
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    message = run_ranks(_load_error, 2, args=(str(directory),), timeout=120)[0]
    after = {p.name: p.read_bytes() for p in step.iterdir()}
    assert before == after  # nothing rewritten or removed
    return message, after


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: flip_byte(d / "__1_0.distcp"), "__1_0.distcp does not match its sha256"),
        (lambda d: os.truncate(d / "__0_0.distcp", 10), "__0_0.distcp has 10 bytes"),
        (lambda d: (d / "rank-1.pt").unlink(), "rank-1.pt is missing"),
        (lambda d: flip_byte(d / ".metadata"), ".metadata does not match its sha256"),
    ],
    ids=["flipped-byte", "truncated", "missing-rank-file", "metadata"],
)
def test_a_damaged_file_is_named_before_any_tensor_is_read(
    copy_of: Path, change: Any, expected: str
) -> None:
    message, _ = _corrupt_and_load(copy_of, change)
    assert expected in message and "resume from another step" in message, message
    assert "\n" not in message


@pytest.mark.timeout(240)
def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(copy_of: Path) -> None:
    message = run_ranks(_load_error, 2, args=(str(copy_of), 32), timeout=120)[0]
    assert "tensor '0.bias' is [16] float32 there and [32] float32 here" in message


@pytest.mark.timeout(240)
def test_only_an_incomplete_save_starts_fresh_and_the_next_save_removes_it(
    tmp_path: Path, dp_saved: Any
) -> None:
    shutil.copytree(dp_saved[1] / "step-3", tmp_path / "step-7.incomplete")
    assert run_ranks(_load_error, 2, args=(str(tmp_path),), timeout=120)[0] == "loaded step None"
    run_ranks(_train_and_save, 2, args=("dp", str(tmp_path)), timeout=180)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]


def test_bad_manager_arguments_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep at least 1"):
        CheckpointManager(tmp_path, keep=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file; pass a directory"):
        CheckpointManager(tmp_path / "file")


@pytest.mark.skipif(sys.platform != "linux", reason="threads are scheduled one by one on Linux")
def test_the_background_writer_yields_the_cpu_to_the_training(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, async_save=True)
    worker = manager._worker
    assert worker is not None
    policy = worker.submit(os.sched_getscheduler, 0).result()
    nice = worker.submit(os.getpriority, os.PRIO_PROCESS, 0).result()
    assert policy == os.SCHED_IDLE or nice == 19
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's thread is untouched
    manager.close()


# -- exact resume of the example after kill -9 ----------------------------------------------
GPT_ARGS = [
    "--max-steps", "8", "--d-model", "32", "--n-layers", "1", "--seq-len", "32",
    "--batch-size", "4", "--eval-every", "100", "--corpus-mb", "0.5",
    "--checkpoint-every", "3", "--dropout", "0.1",
]  # fmt: skip
STEPS = 8
#: The steps every run commits (``--checkpoint-every 3`` and the last; the default keep=3).
SAVED_STEPS = (3, 6, 8)
#: The example's first line of each attempt (``lamina run --max-restarts`` prints them all).
ATTEMPT = re.compile(r"^train_gpt: (starting fresh|resumed) at step \d+ of \d+")
#: The example's summary: how many steps this attempt ran, from which to which.
DONE = re.compile(rf"^done: {STEPS} steps \| .* \| this attempt ran (\d+) steps \((\d+)-(\d+)\)$")
#: The last line of ``lamina checkpoint diff``.
VERDICT = re.compile(r"^(\d+)/(\d+) tensors bitwise equal, (\d+)/(\d+) other entries equal; (.*)$")


def _train_gpt(directory: Path, *extra: str, env: dict[str, str] | None = None) -> str:
    """``lamina run --max-restarts 2`` of the example on 2 ranks; its stdout (every
    attempt's)."""
    cmd = [sys.executable, "-m", "lamina.cli.main", "run", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "2", str(ROOT / "examples" / "train_gpt.py"), *GPT_ARGS]
    cmd += ["--checkpoint-dir", str(directory), *extra]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})}
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def _attempts(stdout: str) -> list[list[str]]:
    """The example's output cut into attempts, each from its ``train_gpt: ... at step``
    line."""
    attempts: list[list[str]] = []
    for line in stdout.splitlines():
        if ATTEMPT.match(line):
            attempts.append([])
        if attempts:
            attempts[-1].append(line)
    return attempts


def _assert_attempts(stdout: str, directory: Path, resumed: int | None) -> None:
    """The first attempt started fresh; with ``resumed``, exactly one more attempt said it
    resumed from ``directory/step-<resumed>`` and ran exactly the steps after it (else the
    first attempt ran them all)."""
    attempts = _attempts(stdout)
    assert len(attempts) == (1 if resumed is None else 2), stdout
    assert attempts[0][0] == f"train_gpt: starting fresh at step 0 of {STEPS}: {STEPS} steps to go"
    start = 0
    if resumed is not None:
        step_dir = directory / f"step-{resumed}"
        assert attempts[1][0] == (
            f"train_gpt: resumed at step {resumed} of {STEPS} from {step_dir}: "
            f"{STEPS - resumed} steps to go"
        ), stdout
        said = [line for line in stdout.splitlines() if "lamina checkpoint: resumed from" in line]
        assert said == [f"lamina checkpoint: resumed from {step_dir}"], stdout
        start = resumed
    done = [m for line in stdout.splitlines() if (m := DONE.match(line))]
    assert len(done) == 1 and done[0].group(0) in attempts[-1], stdout  # the last attempt's
    ran, first, last = (int(g) for g in done[0].groups())
    assert (ran, first, last) == (STEPS - start, start + 1, STEPS), done[0].group(0)


def _diff(a: Path, b: Path, step: int, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``lamina checkpoint diff A B --step N`` (the CLI's function, in this process): its
    exit status and output."""
    from lamina.cli.main import main

    capsys.readouterr()
    code = main(["checkpoint", "diff", str(a), str(b), "--step", str(step)])
    return code, capsys.readouterr().out


def _assert_identical(a: Path, b: Path, step: int, capsys: pytest.CaptureFixture[str]) -> None:
    """``lamina checkpoint diff`` finds every tensor and value of step ``step`` (the model,
    the optimizer, and each rank's RNG states, scheduler and data position) bitwise equal."""
    code, out = _diff(a, b, step, capsys)
    verdict = VERDICT.match(out.splitlines()[-1])
    assert verdict is not None, out
    equal, tensors, equal_values, values, said = verdict.groups()
    assert (code, said) == (0, "identical"), f"step {step}:\n{out}"
    assert equal == tensors and int(tensors) > 0 and equal_values == values and int(values) > 0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The example run once without a kill: its checkpoint root and stdout."""
    directory = tmp_path_factory.mktemp("gpt") / "uninterrupted"
    return directory, _train_gpt(directory)


@pytest.mark.timeout(600)
def test_an_uninterrupted_run_starts_fresh_and_saves_every_stream(
    uninterrupted: tuple[Path, str],
) -> None:
    from lamina.checkpoint.inspect import load_flat, verify_step

    directory, stdout = uninterrupted
    _assert_attempts(stdout, directory, None)
    assert sorted(p.name for p in directory.iterdir()) == [f"step-{s}" for s in SAVED_STEPS]
    final = directory / f"step-{STEPS}"
    names = set(load_flat(final, verify_step(final)))
    for rank in (0, 1):  # what the diffs of the kill tests compare besides DCP's tensors
        for entry in ("rng.torch", "rng.python", "rng.numpy", "scheduler.last_epoch"):
            assert f"rank-{rank}.{entry}" in names, entry
        assert f"rank-{rank}.extra.data.position" in names


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("how", "extra", "env", "resumed"),
    [
        ("kill -9 rank 1 after step 7", ["--kill-at-step", "7", "--kill-rank", "1"], {}, 6),
        (
            "kill -9 rank 0 before the commit of step 6",
            [],
            {"LAMINA_CHECKPOINT_KILL": "before-commit:0:6"},
            3,
        ),
        (
            "kill -9 rank 1 after the shards of an async save of step 6 (step 3 committed)",
            ["--async-save"],
            {"LAMINA_CHECKPOINT_KILL": "after-shards:1:6"},
            3,
        ),
    ],
    ids=["at-a-step", "during-a-save", "during-an-async-save"],
)
def test_a_killed_run_resumes_bitwise_equal_to_an_uninterrupted_one(
    uninterrupted: tuple[Path, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    how: str,
    extra: list[str],
    env: dict[str, str],
    resumed: int,
) -> None:
    """The restarted attempt says it resumed from the last committed step and ran exactly
    the steps after it; every committed step, RNG states included, is bitwise the
    uninterrupted run's. The steps up to the kill were written by the first attempt: two
    uninterrupted runs of the same arguments, which must save the same bits too."""
    directory = tmp_path / "killed"
    stdout = _train_gpt(directory, *extra, env=env)
    assert any(p.name.startswith(".killed") for p in directory.iterdir()), how
    _assert_attempts(stdout, directory, resumed)
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith("step-")) == [
        f"step-{s}" for s in SAVED_STEPS
    ]
    for step in SAVED_STEPS:  # step <= resumed: the first attempt's; after: the resumed one's
        _assert_identical(uninterrupted[0], directory, step, capsys)


def _hsdp(directory: str, save: bool) -> dict[str, Any]:
    lamina.init(mesh="topology")
    model = lamina.distribute(_model(), "hsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(directory)
    if save:
        for _ in range(2):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        manager.save(2, model, optimizer)
        return {"step": 2, "state": _full_state(model, optimizer)}
    step = manager.load_latest(model, optimizer)
    return {"step": step, "state": _full_state(model, optimizer)}


@pytest.mark.timeout(300)
def test_hsdp_saved_on_four_ranks_resumes_on_two(tmp_path: Path) -> None:
    import json

    from topologies_for_tests import two_hosts_of_two

    four = tmp_path / "four.json"
    four.write_text(json.dumps(two_hosts_of_two()))
    two = two_hosts_of_two()
    two["devices"] = two["devices"][:2]
    two["links"] = two["links"][:1]
    two["fast_domains"] = two["fast_domains"][:1]
    (tmp_path / "two.json").write_text(json.dumps(two))
    directory = str(tmp_path / "ckpt")
    saved = run_ranks(
        _hsdp, 4, args=(directory, True), env={"LAMINA_TOPOLOGY": str(four)}, timeout=200
    )
    loaded = run_ranks(
        _hsdp,
        2,
        args=(directory, False),
        env={"LAMINA_TOPOLOGY": str(tmp_path / "two.json")},
        timeout=200,
    )
    for result in loaded:
        assert result["step"] == 2
        assert _equal(result["state"], saved[0]["state"])
