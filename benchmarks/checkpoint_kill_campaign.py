"""kill -9 campaign: the GPT example killed at random moments resumes bitwise exactly.

Trains ``examples/train_gpt.py`` on 2 gloo ranks under ``lamina run --max-restarts 2``
with checkpoints every 3 of 12 steps (dropout on): once uninterrupted, then ``--seeds``
times with a random rank SIGKILLed after a random step (``--kill-at-step``), and
``--seeds`` times with a random rank SIGKILLed in the middle of a random save, right
after DCP's shards (``after-shards``, any rank) or right before the commit
(``before-commit``, rank 0) through ``$LAMINA_CHECKPOINT_KILL``, half of those saves
asynchronous (``--async-save``). Every run must restart,
resume from a committed step, never load an ``.incomplete`` one, and end with a final
checkpoint whose tensors (parameters, optimizer state, RNG) are bitwise equal to the
uninterrupted run's (``lamina checkpoint diff``). Prints a table and writes JSON::

    python benchmarks/checkpoint_kill_campaign.py     # writes results/checkpoint_kill_campaign.json
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import write_results

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 12, 3
GPT_ARGS = [
    "--max-steps", str(STEPS), "--d-model", "32", "--n-layers", "1", "--seq-len", "32",
    "--batch-size", "4", "--eval-every", "100", "--corpus-mb", "0.5",
    "--checkpoint-every", str(EVERY), "--dropout", "0.1",
]  # fmt: skip


def train(directory: Path, extra: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    """(exit status, output, seconds) of one run."""
    cmd = [sys.executable, "-m", "lamina.cli.main", "run", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "2", str(ROOT / "examples" / "train_gpt.py"), *GPT_ARGS]
    cmd += ["--checkpoint-dir", str(directory), *extra]
    start = time.perf_counter()
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )
    return result.returncode, result.stdout + result.stderr, time.perf_counter() - start


def bitwise_equal(a: Path, b: Path) -> tuple[bool, str]:
    """``lamina checkpoint diff A B --step STEPS``: (every tensor bitwise equal, its
    summary line). Tensors only: Python's and NumPy's RNG states differ between any two
    runs, since the example never seeds them (each process starts from OS entropy)."""
    cmd = [sys.executable, "-m", "lamina.cli.main", "checkpoint", "diff", str(a), str(b)]
    result = subprocess.run([*cmd, "--step", str(STEPS)], capture_output=True, text=True)
    lines = (result.stdout or result.stderr).strip().splitlines()
    summary = lines[-1] if lines else ""
    counts = summary.split(" tensors bitwise equal")[0].split("/")
    return len(counts) == 2 and counts[0] == counts[1], summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="runs of each kind (10)")
    parser.add_argument("--output", default="checkpoint_kill_campaign.json")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "reference"
        status, output, _ = train(reference, [], {})
        if status != 0:
            sys.exit(f"the uninterrupted run failed:\n{output[-3000:]}")
        for kind in ("at-a-step", "during-a-save"):
            for seed in range(args.seeds):
                rng = random.Random(f"{kind}-{seed}")
                extra: list[str] = []
                env: dict[str, str] = {}
                if kind == "at-a-step":
                    step, rank = rng.randint(1, STEPS - 1), rng.randint(0, 1)
                    extra = ["--kill-at-step", str(step), "--kill-rank", str(rank)]
                    what = f"rank {rank} after step {step}"
                else:
                    step = EVERY * rng.randint(1, STEPS // EVERY)
                    point = rng.choice(["after-shards", "before-commit"])
                    rank = rng.randint(0, 1) if point == "after-shards" else 0
                    env = {"LAMINA_CHECKPOINT_KILL": f"{point}:{rank}:{step}"}
                    mode = rng.choice(["sync", "async"])
                    extra = ["--async-save"] if mode == "async" else []
                    what = f"rank {rank} {point} of {mode} step {step}"
                directory = Path(tmp) / f"{kind}-{seed}"
                status, output, seconds = train(directory, extra, env)
                killed = any(p.name.startswith(".killed") for p in directory.iterdir())
                resumed = [line for line in output.splitlines() if "resumed from" in line]
                equal, summary = bitwise_equal(reference, directory) if status == 0 else (False, "")
                runs.append(
                    {
                        "kind": kind,
                        "seed": seed,
                        "kill": what,
                        "exit_status": status,
                        "killed": killed,
                        "resumed_from": resumed[-1].split("resumed from ")[-1] if resumed else None,
                        "incomplete_loaded": "incomplete" in "".join(resumed),
                        "bitwise_equal": equal,
                        "diff": summary,
                        "seconds": round(seconds, 1),
                    }
                )
                r = runs[-1]
                print(
                    f"{kind:14} seed {seed}: kill {what:40} exit {status} resumed "
                    f"{r['resumed_from'] or '-':>10}  bitwise {'yes' if equal else 'NO'}",
                    flush=True,
                )
    passed = sum(r["exit_status"] == 0 and r["killed"] and r["bitwise_equal"] for r in runs)
    print(f"{passed}/{len(runs)} runs killed, resumed and bitwise equal to the uninterrupted run")
    write_results(
        "checkpoint_kill_campaign",
        args.output,
        {"steps": STEPS, "checkpoint_every": EVERY, "ranks": 2, "passed": passed, "runs": runs},
    )


if __name__ == "__main__":
    main()
