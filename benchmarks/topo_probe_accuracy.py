"""How close ``lamina topo probe`` comes to the rate an emulated link is shaped to.

For each rate, ``lamina topo probe`` runs under ``lamina emulate --hosts 2
--nproc-per-host 2 --rank-order interleaved`` (``--repeats`` times); the table shows the
measured inter-host bandwidth and latency and the error against the shaped rate. Needs
root::

    python benchmarks/topo_probe_accuracy.py   # writes results/topo_probe_accuracy.json
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

RATES_MBIT = (100, 200, 800)


def probe_once(rate_mbit: int, nbytes: str) -> tuple[float, float]:
    """(measured Mbit/s, latency us) of the inter-host link of one emulated run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "topology.json"
        cmd = [
            sys.executable, "-m", "lamina.cli.main", "emulate", "--hosts", "2",
            "--nproc-per-host", "2", "--link", f"{rate_mbit}mbit", "--rank-order",
            "interleaved", "--", "lamina", "topo", "probe", "--bytes", nbytes,
            "--output", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
        link = json.loads(out.read_text())["default_link"]
        return float(link["bandwidth_gbps"]) * 8e3, float(link["latency_us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bytes", default="8M", help="bytes per probe transfer")
    parser.add_argument("--output", default="topo_probe_accuracy.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("topo_probe_accuracy.py: lamina emulate needs root (network namespaces)")
    results: list[dict[str, Any]] = []
    for rate in RATES_MBIT:
        runs = [probe_once(rate, args.bytes) for _ in range(args.repeats)]
        measured = statistics.median(r[0] for r in runs)
        results.append(
            {
                "shaped_mbit": rate,
                "measured_mbit": measured,
                "error": measured / rate - 1,
                "latency_us": statistics.median(r[1] for r in runs),
                "runs": [{"mbit": m, "latency_us": lat} for m, lat in runs],
            }
        )
        print(f"  {rate} Mbit/s: measured {measured:.1f} ({measured / rate - 1:+.1%})", flush=True)
    print(f"{'shaped Mbit/s':>14}{'measured':>10}{'error':>8}{'latency us':>12}")
    for r in results:
        print(
            f"{r['shaped_mbit']:14d}{r['measured_mbit']:10.1f}{r['error']:+8.1%}"
            f"{r['latency_us']:12.1f}"
        )
    write_results(
        "topo_probe_accuracy",
        args.output,
        {
            "hosts": 2,
            "ranks_per_host": 2,
            "probe_bytes": args.bytes,
            "repeats": args.repeats,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
