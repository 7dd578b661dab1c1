"""The flat all-reduce on an emulated 2-host cluster: hosts in order vs interleaved.

Runs ``lamina bench collectives`` unchanged under ``lamina emulate`` (2 hosts x 2 gloo
ranks, each host's uplink shaped with tc) for each (link, size) case, with the ranks
ordered by host and interleaved across hosts (``srun --distribution=cyclic``), the two
orders alternating, ``--repeats`` times; prints the medians and writes JSON. These are
the raw baselines the topology-aware collectives are measured against. Needs root::

    python benchmarks/emulated_collectives.py     # writes results/emulated_collectives.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _results import write_results

#: (link, message size) cases; the sizes are the all-reduce buffers.
CASES = (("200mbit", "8M"), ("800mbit", "16M"))
ORDERS = ("ordered", "interleaved")
HOSTS, PER_HOST = 2, 2


def run_case(link: str, size: str, order: str, iters: int) -> float:
    """Median all-reduce time (ms, slowest rank) of one emulated run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        nproc = ["--nproc-per-node", str(PER_HOST)] if order == "ordered" else []
        cmd = [
            sys.executable, "-m", "lamina.cli.main", "emulate", "--hosts", str(HOSTS),
            "--nproc-per-host", str(PER_HOST), "--link", link, "--rank-order", order, "--",
            "lamina", "bench", "collectives", *nproc, "--ops", "all_reduce",
            "--min-bytes", size, "--max-bytes", size, "--iters", str(iters), "--warmup", "1",
            "--json", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=900)
        result = json.loads(out.read_text())
        assert result["world_size"] == HOSTS * PER_HOST
        return float(result["results"][0]["time_us"]) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per (case, order)")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduces per run")
    parser.add_argument("--output", default="emulated_collectives.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("emulated_collectives.py: lamina emulate needs root (network namespaces)")
    results: list[dict[str, Any]] = []
    for link, size in CASES:
        runs: dict[str, list[float]] = {o: [] for o in ORDERS}
        for repeat in range(args.repeats):
            for order in ORDERS if repeat % 2 == 0 else ORDERS[::-1]:
                runs[order].append(run_case(link, size, order, args.iters))
                print(f"  {link} {size} {order}: {runs[order][-1]:.1f} ms", flush=True)
        medians = {o: statistics.median(runs[o]) for o in ORDERS}
        results.append(
            {
                "link": link,
                "bytes": size,
                "runs_ms": runs,
                "median_ms": medians,
                "interleaved_over_ordered": medians["interleaved"] / medians["ordered"],
            }
        )
    print(f"{'link':9}{'size':>6}{'ordered ms':>12}{'interleaved ms':>16}{'ratio':>8}")
    for r in results:
        m = r["median_ms"]
        print(
            f"{r['link']:9}{r['bytes']:>6}{m['ordered']:12.1f}{m['interleaved']:16.1f}"
            f"{r['interleaved_over_ordered']:8.2f}"
        )
    write_results(
        "emulated_collectives",
        args.output,
        {
            "hosts": HOSTS,
            "ranks_per_host": PER_HOST,
            "collective": "all_reduce (gloo, flat ring over the world group), float32",
            "time": "median over iters of the slowest rank, then median over repeats",
            "repeats": args.repeats,
            "iters": args.iters,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
