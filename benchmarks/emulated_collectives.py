"""The all-reduce algorithms on an emulated 2-host cluster, beside the cost model.

Runs ``lamina bench collectives --algorithm all`` unchanged under ``lamina emulate``
(2 hosts x 2 gloo ranks, ranks interleaved across the hosts as ``srun
--distribution=cyclic`` numbers them, each host's uplink shaped with tc) for every link
speed, ``--repeats`` times. Each run calibrates the cost model on the job (at 1-16 MiB
phase sizes), then times flat, ordered, hierarchical, pipelined, the model's choice
(``auto``) and the cross-host phase alone at each size, the algorithms taking turns;
this script takes the median over runs, prints the table with the model's error and the
acceptance ratios, and writes JSON. Needs root::

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

LINKS = ("100mbit", "200mbit", "800mbit")
SIZES = ("8M", "16M")
HOSTS, PER_HOST = 2, 2
NAMES = ("flat", "ordered", "hierarchical", "pipelined", "auto", "inter-phase")


def run_link(link: str, iters: int) -> list[dict[str, Any]]:
    """The algorithm rows of one emulated run (every size)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [
            sys.executable, "-m", "lamina.cli.main", "emulate", "--hosts", str(HOSTS),
            "--nproc-per-host", str(PER_HOST), "--link", link, "--rank-order", "interleaved",
            "--", "lamina", "bench", "collectives", "--algorithm", "all",
            "--min-bytes", SIZES[0], "--max-bytes", SIZES[-1], "--iters", str(iters),
            "--warmup", "1", "--json", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=900)
        result = json.loads(out.read_text())
        assert result["world_size"] == HOSTS * PER_HOST
        rows: list[dict[str, Any]] = result["algorithms"]
        for row in rows:
            row["model"] = result["model"]
        return rows


def summarize(link: str, runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per size: each algorithm's median time and prediction over the runs, and ratios."""
    out = []
    for nbytes in sorted({row["bytes"] for rows in runs for row in rows}):
        entry: dict[str, Any] = {"link": link, "bytes": nbytes, "algorithms": {}}
        for name in NAMES:
            rows = [
                r for rows in runs for r in rows if r["bytes"] == nbytes and r["algorithm"] == name
            ]
            if not rows:
                continue
            measured = statistics.median(r["time_us"] for r in rows) / 1e3
            predicted = statistics.median(r["predicted_us"] for r in rows) / 1e3
            entry["algorithms"][name] = {
                "median_ms": measured,
                "predicted_ms": predicted,
                "model_error": (predicted - measured) / measured,
                "runs_ms": [r["time_us"] / 1e3 for r in rows],
                "chosen": sorted({r["chosen"] for r in rows}),
                "chunks": sorted({r["chunks"] for r in rows}),
            }
        algos = entry["algorithms"]
        auto = algos["auto"]["median_ms"]
        others = [algos[n]["median_ms"] for n in ("flat", "ordered", "hierarchical", "pipelined")]
        entry["flat_over_auto"] = algos["flat"]["median_ms"] / auto
        entry["ordered_over_auto"] = algos["ordered"]["median_ms"] / auto
        entry["auto_over_best_other"] = auto / min(others)
        if "inter-phase" in algos:
            entry["pipelined_over_inter_phase"] = (
                algos["pipelined"]["median_ms"] / algos["inter-phase"]["median_ms"]
            )
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="emulated runs per link")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduces per run")
    parser.add_argument("--links", nargs="+", default=list(LINKS), help="link speeds")
    parser.add_argument("--output", default="emulated_collectives.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("emulated_collectives.py: lamina emulate needs root (network namespaces)")
    results: list[dict[str, Any]] = []
    for link in args.links:
        runs = []
        for repeat in range(args.repeats):
            runs.append(run_link(link, args.iters))
            print(f"  {link}: run {repeat + 1} of {args.repeats} done", flush=True)
        results += summarize(link, runs)
    header = f"{'link':9}{'size':>6}" + "".join(f"{n:>14}" for n in NAMES)
    print(header + "   (measured ms / model error)")
    for r in results:
        cells = []
        for name in NAMES:
            a = r["algorithms"].get(name)
            cells.append(f"{a['median_ms']:8.1f}/{a['model_error']:+4.0%}" if a else f"{'-':>14}")
        print(f"{r['link']:9}{r['bytes'] >> 20:>5}M" + "".join(f"{c:>14}" for c in cells))
    print(
        f"{'link':9}{'size':>6}{'flat/auto':>11}{'ordered/auto':>14}{'auto/best':>11}{'pipe/inter':>12}"
    )
    for r in results:
        print(
            f"{r['link']:9}{r['bytes'] >> 20:>5}M{r['flat_over_auto']:11.2f}"
            f"{r['ordered_over_auto']:14.2f}{r['auto_over_best_other']:11.3f}"
            f"{r.get('pipelined_over_inter_phase', float('nan')):12.3f}"
        )
    write_results(
        "emulated_collectives",
        args.output,
        {
            "hosts": HOSTS,
            "ranks_per_host": PER_HOST,
            "rank_order": "interleaved",
            "collective": "all_reduce, float32, gloo; algorithms of lamina.comm.algorithms",
            "time": "median over iters of the slowest rank, then median over repeats",
            "repeats": args.repeats,
            "iters": args.iters,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
