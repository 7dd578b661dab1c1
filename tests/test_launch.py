"""Multi-node launch from a scheduler's environment: SLURM host lists and task layouts,
Kubernetes PyTorchJob pods, and what ``lamina run`` hands torchrun for each."""

from __future__ import annotations

from pathlib import Path

import pytest

from lamina.cli.run import plan_launch
from lamina.errors import ConfigError
from lamina.launch import NodeLaunch, detect, expand_nodelist, expand_task_counts
from lamina.testing.cli import run_lamina

pytestmark = [pytest.mark.portable, pytest.mark.cross_release]


# -- SLURM host lists -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[01-03,07],gpu-a1", ["node01", "node02", "node03", "node07", "gpu-a1"]),
        ("a1,b2", ["a1", "b2"]),
        ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("single", ["single"]),
    ],
)
def test_nodelists_expand_in_order_with_their_zero_padding(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node[01-03", "SLURM_JOB_NODELIST='node[01-03' has an unclosed '['; fix the host list"),
        ("node01]", "SLURM_JOB_NODELIST='node01]' has a ']' without '['; fix the host list"),
        ("n[5-3]", "SLURM_JOB_NODELIST='n[5-3]': range '5-3' runs backwards; write 3-5"),
        ("n[a-b]", "SLURM_JOB_NODELIST='n[a-b]': 'a-b' is not a number or a range like 01-03"),
        ("a,,b", "SLURM_JOB_NODELIST='a,,b' has an empty entry; fix the host list"),
        ("", "SLURM_JOB_NODELIST is empty; run under srun/sbatch, which set it"),
    ],
)
def test_malformed_nodelists_are_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        expand_nodelist(text)
    assert str(excinfo.value) == message


def test_task_counts_expand_repeats() -> None:
    assert expand_task_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_task_counts("8") == [8]
    with pytest.raises(ConfigError, match=r"'x' is not a count like 4 or 2\(x3\)"):
        expand_task_counts("x")


# -- SLURM job steps --------------------------------------------------------------------
def _slurm(**overrides: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[01-03,07]",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "4",
        "SLURM_TASKS_PER_NODE": "1(x4)",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "-"}


def test_one_slurm_task_per_node_is_one_torchrun_agent_per_node() -> None:
    found = detect(_slurm())
    assert found == NodeLaunch(
        "slurm", 4, 2, "node01", 20000 + 4242, None, ("node01", "node02", "node03", "node07")
    )
    assert found.torchrun_flags(set()) == [
        "--nnodes", "4", "--node-rank", "2", "--master-addr", "node01", "--master-port", "24242",
    ]  # fmt: skip


def test_one_slurm_task_per_rank_keeps_the_procid_as_the_rank() -> None:
    # srun --ntasks-per-node=2 --distribution=cyclic: procids 0,2 on node 0 and 1,3 on node 1
    env = _slurm(
        SLURM_JOB_NODELIST="h[0-1]",
        SLURM_NNODES="2",
        SLURM_NODEID="1",
        SLURM_PROCID="3",
        SLURM_NTASKS="4",
        SLURM_TASKS_PER_NODE="2(x2)",
        MASTER_PORT="31000",
    )
    found = detect(env)
    assert found is not None
    assert (found.nnodes, found.node_rank, found.nproc_per_node) == (4, 3, 1)
    assert (found.master_addr, found.master_port) == ("h0", 31000)
    assert detect({**env, "SLURM_TASKS_PER_NODE": "-", "SLURM_NTASKS_PER_NODE": "2"}) == found


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"SLURM_NNODES": "3"},
            "SLURM_NNODES=3 but SLURM_JOB_NODELIST='node[01-03,07]' names 4 host(s); "
            "run lamina under srun, which sets both",
        ),
        ({"SLURM_NODEID": "4"}, "SLURM_NODEID=4 is outside SLURM_NNODES=4"),
        ({"SLURM_NODEID": "two"}, "SLURM_NODEID='two' is not an integer; run under the scheduler"),
        (
            {"SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_PROCID": "9", "SLURM_NTASKS": "8"},
            "SLURM_PROCID=9 is outside SLURM_NTASKS=8",
        ),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port; use 1-65535"),
    ],
)
def test_inconsistent_slurm_variables_are_named(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        detect(_slurm(**overrides))
    assert str(excinfo.value) == message


def test_outside_a_job_step_there_is_no_scheduler() -> None:
    assert detect({}) is None
    assert detect(_slurm(SLURM_PROCID="-", SLURM_NODEID="-")) is None  # sbatch, not srun
    assert detect({"PET_NNODES": "2", "PET_NODE_RANK": "1"}) is None  # torchrun reads these


# -- Kubernetes ---------------------------------------------------------------------------
def test_a_pytorchjob_pod_is_one_node_of_the_job() -> None:
    pod = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1"}
    assert detect(pod) == NodeLaunch("kubernetes", 3, 1, "job-master-0", 23456)
    assert detect({**pod, "LOCAL_RANK": "0"}) is None  # inside a rank: not a pod's variables
    with pytest.raises(ConfigError, match=r"RANK=3 is outside WORLD_SIZE=3; check the PyTorchJob"):
        detect({**pod, "RANK": "3"})


# -- what lamina run hands torchrun --------------------------------------------------------
def test_lamina_run_adds_the_schedulers_flags_the_user_did_not_give() -> None:
    plan = plan_launch(["--nproc-per-node", "8", "train.py", "--lr", "1"], environ=_slurm())
    assert plan.scheduler is not None and not plan.added_standalone
    assert plan.torchrun_argv == [
        "--nnodes", "4", "--node-rank", "2", "--master-addr", "node01", "--master-port", "24242",
        "--nproc-per-node", "8", "train.py", "--lr", "1",
    ]  # fmt: skip
    mine = plan_launch(["--master-port", "1234", "--nnodes", "4", "t.py"], environ=_slurm())
    assert mine.torchrun_argv == [
        "--node-rank", "2", "--master-addr", "node01", "--master-port", "1234", "--nnodes", "4",
        "t.py",
    ]  # fmt: skip


@pytest.mark.parametrize("flag", [["--standalone"], ["--rdzv-endpoint", "h:1"]])
def test_a_rendezvous_the_user_chose_overrides_the_scheduler(flag: list[str]) -> None:
    plan = plan_launch([*flag, "t.py"], environ=_slurm())
    assert plan.scheduler is None and plan.torchrun_argv == [*flag, "t.py"]


def test_a_missing_script_is_one_line_and_no_rank_starts(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_script.py"
    result = run_lamina("run", "--nproc-per-node", "2", str(missing))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"lamina: error: script {str(missing)!r} does not exist; pass the path of a Python "
        "file (or -m MODULE)"
    ]
    assert "ChildFailedError" not in result.stderr + result.stdout


# -- a process group someone else created (Ray Train, a custom launcher) -------------------
def _join_existing_group() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    import lamina

    dist.init_process_group("gloo")  # what Ray Train's TorchTrainer does before the loop
    runtime = lamina.init()
    value = torch.tensor([float(runtime.rank + 1)])
    dist.all_reduce(value)
    owned = runtime.owns_process_group
    lamina.shutdown()
    still_there = dist.is_initialized()  # the caller's group outlives lamina's runtime
    dist.destroy_process_group()
    return {"rank": runtime.rank, "sum": value.item(), "owned": owned, "kept": still_there}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_init_joins_a_process_group_the_caller_created() -> None:
    from lamina.testing import run_ranks

    results = run_ranks(_join_existing_group, 2, timeout=90)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 3.0 and r["owned"] is False and r["kept"] for r in results), results
