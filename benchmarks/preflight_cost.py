"""Cost of the pre-flight cross-rank verification for the examples' GPT, per job.

``python benchmarks/preflight_cost.py [--nproc 2 4] [--rounds 3]`` launches one torchrun
job per rank count. Each job wraps the GPT of ``examples/train_gpt.py`` (4 layers,
d_model 128, vocab 190) ``--rounds`` times with ``"dp"`` and with ``"zero3"``; every
wrap runs the verification once (arrival through the store, digest all-gather, no
mismatch). The table shows, per strategy, the median over rounds of the slowest rank's
verification time, next to the time to build the plan (capture + buckets or layout)
for scale. Results: ``benchmarks/results/preflight_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent / "examples"))


def _child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import lamina
    from _gpt_model import GPT, GPTConfig

    rt = lamina.init()
    rows: dict[str, dict[str, list[float]]] = {}
    example = torch.zeros(16, 128, dtype=torch.long)
    for strategy in ("dp", "zero3"):
        verify_s, wrap_s = [], []
        for _ in range(args.rounds):
            torch.manual_seed(0)
            net = GPT(GPTConfig(vocab_size=190, seq_len=128, d_model=128, n_layers=4, n_heads=4))
            options = {"example_inputs": (example,)} if strategy == "dp" else {}
            dist.barrier()
            t0 = time.perf_counter()
            model = lamina.distribute(net, strategy, **options)
            wrapped = time.perf_counter() - t0
            report = model.preflight
            assert report is not None
            times = torch.tensor([report.seconds, wrapped], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            verify_s.append(float(times[0]))
            wrap_s.append(float(times[1]))
        rows[strategy] = {"verify_s": verify_s, "wrap_s": wrap_s}
    if rt.is_main:
        Path(args.child_out).write_text(json.dumps(rows))
    lamina.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default="preflight_cost.json")
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out is not None:
        _child(args)
        return
    table = []
    for nproc in args.nproc:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), __file__,
                "--rounds", str(args.rounds), "--child-out", str(out),
            ]  # fmt: skip
            env = {**os.environ, "LAMINA_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
            print(f"{nproc} ranks ...", flush=True)
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            rows = json.loads(out.read_text())
        for strategy, row in rows.items():
            table.append(
                {
                    "ranks": nproc,
                    "strategy": strategy,
                    "verify_s_median": statistics.median(row["verify_s"]),
                    "verify_s_max": max(row["verify_s"]),
                    "wrap_s_median": statistics.median(row["wrap_s"]),
                    "rounds": len(row["verify_s"]),
                }
            )
    print(f"\n{'ranks':>5}  {'strategy':<8}  {'verify (median)':>15}  {'verify (max)':>12}  "
          f"{'whole wrap':>10}")  # fmt: skip
    for r in table:
        print(
            f"{r['ranks']:>5}  {r['strategy']:<8}  {r['verify_s_median']:>13.3f} s  "
            f"{r['verify_s_max']:>10.3f} s  {r['wrap_s_median']:>8.2f} s"
        )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / args.output
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores, gloo, CPU"}
    path.write_text(json.dumps({"meta": meta, "results": table}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
