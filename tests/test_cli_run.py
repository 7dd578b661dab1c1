"""``lamina run``: torchrun's flags pass through, ``--backend`` is checked and exported."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import pytest

from lamina.cli.run import add_run_parser, plan_launch, run_command, strip_backend
from lamina.errors import BackendNotFoundError
from lamina.testing.cli import run_lamina

RANK_SCRIPT = """\
import os, sys


def main():
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if "--fail-first-attempt" in sys.argv and restarts == 0:
        sys.exit(3)  # before torch's import: a failed attempt costs no CPU
    import torch
    import torch.distributed as dist
    import lamina

    with lamina.init() as rt:
        value = torch.tensor([float(rt.rank + 1)], device=rt.device)
        dist.all_reduce(value)
        # one write per line: torchrun runs ranks unbuffered on a shared stdout
        sys.stdout.write(
            f"rank={rt.rank} world={rt.world_size} sum={value.item():g} "
            f"env={os.environ.get('LAMINA_BACKEND')} backend={rt.backend.name} "
            f"restarts={restarts} args={sys.argv[1:]}\\n"
        )


if __name__ == "__main__":
    main()
"""


@pytest.fixture
def rank_script(tmp_path: Path) -> str:
    path = tmp_path / "ranks.py"
    path.write_text(RANK_SCRIPT)
    return str(path)


# -- planning (no processes) -----------------------------------------------------------
def test_backend_is_taken_out_and_the_rest_passes_through_in_order() -> None:
    plan = plan_launch(
        ["--nproc-per-node", "2", "--backend", "cpu", "--max-restarts", "0", "s.py", "-x"]
    )
    assert plan.backend == "cpu"
    assert plan.torchrun_argv == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "s.py",
        "-x",
    ]
    assert plan.added_standalone


@pytest.mark.parametrize("spelling", [["--backend=cpu"], ["--back", "cpu"], ["--backend", "cpu"]])
def test_every_spelling_of_backend_is_recognised(spelling: list[str]) -> None:
    plan = plan_launch(["--standalone", *spelling, "s.py"])
    assert (plan.backend, plan.torchrun_argv) == ("cpu", ["--standalone", "s.py"])


def test_script_arguments_are_never_touched() -> None:
    argv = ["s.py", "--backend", "mine", "--nproc-per-node", "9", "--standalone"]
    plan = plan_launch(argv)
    assert plan.backend is None
    assert plan.torchrun_argv == ["--standalone", *argv]
    assert strip_backend(["--backend", "cpu", *argv], len(argv)) == argv


@pytest.mark.parametrize(
    "flags",
    [
        ["--standalone"],
        ["--rdzv-endpoint", "localhost:29400", "--rdzv-backend", "c10d"],
        ["--master-port", "29511"],
        ["--master_addr", "10.0.0.1"],
        ["--nnodes", "2", "--node-rank", "0", "--master-addr", "h0"],
        ["--nnodes", "1:2"],
    ],
)
def test_standalone_is_not_added_when_the_user_chose_a_rendezvous(flags: list[str]) -> None:
    plan = plan_launch([*flags, "s.py"])
    assert not plan.added_standalone
    assert plan.torchrun_argv == [*flags, "s.py"]


@pytest.mark.parametrize("nnodes", [[], ["--nnodes", "1"], ["--nnodes=1:1"]])
def test_standalone_is_added_for_one_node_without_a_rendezvous(nnodes: list[str]) -> None:
    assert plan_launch([*nnodes, "s.py"]).torchrun_argv == ["--standalone", *nnodes, "s.py"]


def test_torchrun_environment_variables_count_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MASTER_PORT", "29555")
    assert not plan_launch(["s.py"]).added_standalone


def test_subparser_hands_every_token_to_run_command_verbatim() -> None:
    parser = argparse.ArgumentParser(prog="lamina")
    add_run_parser(parser.add_subparsers(dest="command", required=True))
    argv = ["--nproc-per-node", "2", "--help", "--", "-m", "x.py", "-h"]
    args = parser.parse_args(["run", *argv])
    assert args.run_argv == argv
    assert args.func is run_command


def test_help_and_usage_errors_come_from_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(argparse.Namespace(run_argv=["--help"])) == 0
    shown = capsys.readouterr().out
    for flag in ("--nproc-per-node", "--rdzv-endpoint", "--max-restarts", "--backend", "29500"):
        assert flag in shown
    assert run_command(argparse.Namespace(run_argv=["--nproc-per-node", "2"])) == 2
    assert "training_script" in capsys.readouterr().err


def test_unknown_backend_fails_before_launch() -> None:
    with pytest.raises(BackendNotFoundError, match=r"installed backends: .*cpu"):
        run_command(argparse.Namespace(run_argv=["--backend", "nope", "missing.py"]))


# -- the command, as a user runs it ------------------------------------------------------
def test_unknown_backend_is_one_line_and_nothing_starts(rank_script: str) -> None:
    started = time.perf_counter()
    result = run_lamina("run", "--nproc-per-node", "2", "--backend", "nope", rank_script)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "unknown backend 'nope'" in lines[0] and "installed backends:" in lines[0]
    assert "cpu" in lines[0]
    assert "rank=" not in result.stdout
    # one interpreter start (measured 7-8.5 s at load average 10-11 on 2 cores, 22 s at
    # 15-17), no ranks
    assert time.perf_counter() - started < 100


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_ranks_all_reduce_on_the_backend_given(
    rank_script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LAMINA_BACKEND", raising=False)
    result = run_lamina(
        "run", "--nproc-per-node", "2", "--backend", "cpu", rank_script, "--backend", "own"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank="))
    assert len(lines) == 2, result.stdout
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank={rank} world=2 sum=3 env=cpu backend=cpu restarts=0")
        assert line.endswith("args=['--backend', 'own']")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_max_restarts_reaches_torchrun(rank_script: str) -> None:
    flags = ["--nproc-per-node", "2", "--monitor-interval", "0.1"]
    failed = run_lamina("run", *flags, "--max-restarts", "0", rank_script, "--fail-first-attempt")
    assert failed.returncode == 3, failed.stderr[-3000:]  # the failed rank's own exit status
    assert "FAILED" in failed.stderr and "exitcode  : 3" in failed.stderr

    restarted = run_lamina(
        "run", *flags, "--max-restarts", "1", rank_script, "--fail-first-attempt"
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    found = re.findall(r"rank=(\d) world=2 sum=3 .* restarts=1", restarted.stdout)
    assert sorted(found) == ["0", "1"], restarted.stdout
