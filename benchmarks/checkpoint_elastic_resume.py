"""A node leaves an elastic job: the rest resumes from the last checkpoint on fewer ranks.

Starts two ``lamina run --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d
--max-restarts 3`` agents on this machine (two "nodes" of one rank each, torchrun's
elastic rendezvous on the first one's port) training ``examples/train_gpt.py`` with a
checkpoint every 10 steps; once step 30 is committed, every process of the second node
(agent and worker) is SIGKILLed. torchrun restarts the survivor, whose rendezvous
closes with one node: the job goes on with 1 rank, resumes from the last checkpoint
saved on 2 ranks (DCP reshards) and trains to the end. The example's data position
(``EpochSampler``: windows the whole job consumed) must then be the windows of the
steps before the resume at 2 ranks x ``--batch-size`` plus those after it at 1 rank:
the survivor carried on mid-epoch, repeating and skipping nothing. Prints what
happened and writes JSON::

    python benchmarks/checkpoint_elastic_resume.py   # results/checkpoint_elastic_resume.json
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _results import write_results

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, KILL_AFTER, BATCH = 200, 10, 30, 4
GPT_ARGS = [
    "--max-steps", str(STEPS), "--d-model", "32", "--n-layers", "1", "--seq-len", "32",
    "--batch-size", str(BATCH), "--eval-every", "50", "--corpus-mb", "0.5",
    "--checkpoint-every", str(EVERY),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def data_position(step: Path) -> dict[str, int] | None:
    """The example's sampler position saved in ``step`` (rank 0's ``extra``)."""
    path = step / "rank-0.pt"
    if not path.is_file():
        return None
    data = torch.load(path, weights_only=True)["extra"]["data"]
    return {"epoch": int(data["epoch"]), "position": int(data["position"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    parser.add_argument("--output", default="checkpoint_elastic_resume.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ckpt"
        port = free_port()
        agents = []
        for node in range(2):
            cmd = [
                sys.executable, "-m", "lamina.cli.main", "run", "--nnodes", "1:2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "3",
                str(ROOT / "examples" / "train_gpt.py"), *GPT_ARGS,
                "--checkpoint-dir", str(directory), "--eval-batches", str(4 + node),
            ]  # fmt: skip
            log = (Path(tmp) / f"node{node}.log").open("w")
            agents.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
            time.sleep(3)  # node 0 hosts the rendezvous store
        start = time.monotonic()
        while not (directory / f"step-{KILL_AFTER}").is_dir():
            if time.monotonic() - start > args.timeout or agents[0].poll() is not None:
                sys.exit("the job did not reach its first checkpoints")
            time.sleep(0.5)
        # node 1 dies: its wrapper, its torchrun agent and its worker (torchrun starts
        # workers in sessions of their own, so the agent's group is not enough)
        killed = subprocess.run(["pkill", "-9", "-f", "--", "--eval-batches 5"], check=False)
        killed_at = time.monotonic() - start
        try:
            status = agents[0].wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(agents[0].pid, signal.SIGKILL)
            sys.exit("the surviving node did not finish in time")
        agents[1].wait(timeout=30)
        output = (Path(tmp) / "node0.log").read_text()
        worlds = [int(m) for m in re.findall(r"\| (\d+) rank\(s\) on", output)]
        resumed = re.findall(r"resumed from \S*/(step-\d+) \(saved on (\d+) rank", output)
        done = re.findall(r"done: (\d+) steps", output)
        result = {
            "exit_status": status,
            "killed_node_1_after_s": round(killed_at, 1),
            "pkill_status": killed.returncode,
            "world_sizes": worlds,
            "resumed_from": resumed[-1][0] if resumed else None,
            "saved_on_ranks": int(resumed[-1][1]) if resumed else None,
            "final_steps": int(done[-1]) if done else None,
            "committed_steps": sorted(int(p.name[5:]) for p in directory.glob("step-*")),
            "data_position": data_position(directory / f"step-{STEPS}"),
        }
    print(
        f"exit {result['exit_status']}: world sizes {result['world_sizes']}, resumed from "
        f"{result['resumed_from']} saved on {result['saved_on_ranks']} rank(s), trained to "
        f"step {result['final_steps']} of {STEPS}"
    )
    ok = result["exit_status"] == 0 and result["world_sizes"][-1:] == [1]
    ok = ok and result["saved_on_ranks"] == 2 and result["final_steps"] == STEPS
    if result["resumed_from"]:
        resumed_at = int(str(result["resumed_from"]).removeprefix("step-"))
        expected = {"epoch": 0, "position": BATCH * (2 * resumed_at + (STEPS - resumed_at))}
        result["expected_data_position"] = expected
        ok = ok and result["data_position"] == expected
    write_results("checkpoint_elastic_resume", args.output, {**result, "ok": ok})
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
