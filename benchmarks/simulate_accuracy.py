"""How close ``"auto"``'s predictions (each candidate's plan priced node by node) come to
the measured step, over repeats: every strategy and composition ``benchmarks/auto_choice.py``
runs, on loopback (2 ranks; 4 ranks as 2 x 2) and on 2 emulated hosts x 2 ranks at 100,
200 and 800 Mbit/s, three repeats in one sitting (each repeat: every setting once, in
turn; each a fresh decision and fresh measurements).

For each setting, model and candidate: the prediction of each repeat beside the measured
median over the repeats and their range. A prediction counts as close when it is within
15% of that median, or, where the range is itself wider than 15% of the median, inside
the range. Also each repeat's ``auto`` choice against the best candidate measured in it:
the chosen candidate distributed by hand (``chosen/best``) and ``"auto"``'s own model
(``auto/best``; the same strategy, so the two differ by the machine's noise only).
Needs root for the emulated settings::

    python benchmarks/simulate_accuracy.py                 # -> results/simulate_accuracy.json
    python benchmarks/simulate_accuracy.py --settings loopback2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from _results import RESULTS, write_results
from auto_choice import MODELS, SETTINGS, _launch

#: A prediction this close to the measured median counts as close.
WITHIN = 0.15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="*", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--models", nargs="*", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per repeat")
    parser.add_argument("--steps", type=int, default=3, help="most steps per variant per round")
    parser.add_argument("--output", default="simulate_accuracy.json")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.settings}
    began = time.perf_counter()
    for repeat in range(1, args.repeats + 1):
        for setting in args.settings:
            print(f"== repeat {repeat}/{args.repeats}: {setting} "
                  f"({time.perf_counter() - began:.0f} s so far)", flush=True)  # fmt: skip
            part = RESULTS / f"auto_choice.{setting}.part.json"
            part.unlink(missing_ok=True)
            status = _launch(setting, args)
            if status != 0 or not part.is_file():
                sys.exit(f"simulate_accuracy: {setting} failed in repeat {repeat} (exit {status})")
            runs[setting].append(json.loads(part.read_text()))
            part.unlink()
    rows, choices = summarize(runs)
    print_table(rows, choices)
    close = [r for r in rows if r["close"]]
    within = [r for r in rows if r["within"]]
    write_results(
        "simulate_accuracy",
        args.output,
        {
            "repeats": args.repeats,
            "rounds": args.rounds,
            "within": WITHIN,
            "wall_s": time.perf_counter() - began,
            "predictions": len(rows),
            "within_share": len(within) / len(rows) if rows else None,
            "close_share": len(close) / len(rows) if rows else None,
            "rows": rows,
            "auto_choices": choices,
            "runs": {
                setting: [
                    [{k: v for k, v in m.items() if k != "profile"} for m in run["models"]]
                    for run in repeats
                ]
                for setting, repeats in runs.items()
            },
        },
    )


def summarize(
    runs: dict[str, list[dict[str, Any]]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per (setting, model, candidate, repeat) and one per auto choice."""
    rows, choices = [], []
    for setting, repeats in runs.items():
        for index, model in enumerate(repeats[0]["models"]):
            name = model["model"]
            measured: dict[str, list[float]] = {}
            for run in repeats:
                for c in run["models"][index]["candidates"]:
                    if c["measured_s"]:
                        measured.setdefault(c["candidate"], []).append(c["measured_s"])
            for k, run in enumerate(repeats, 1):
                m = run["models"][index]
                choices.append(
                    {
                        "setting": setting,
                        "model": name,
                        "repeat": k,
                        "auto": m["auto_choice"],
                        "best": m["best_measured"],
                        "auto_over_best": m["auto_over_best"],
                        "chosen_over_best": m["chosen_candidate_over_best"],
                    }
                )
                for c in m["candidates"]:
                    got = measured.get(c["candidate"])
                    if not c["predicted_s"] or not got:
                        continue
                    median, low, high = statistics.median(got), min(got), max(got)
                    error = c["predicted_s"] / median - 1
                    wide = (high - low) / median > WITHIN
                    rows.append(
                        {
                            "setting": setting,
                            "model": name,
                            "candidate": c["candidate"],
                            "repeat": k,
                            "predicted_s": c["predicted_s"],
                            "interval_s": c.get("interval_s"),
                            "measured_median_s": median,
                            "measured_range_s": [low, high],
                            "error": error,
                            "within": abs(error) <= WITHIN,
                            "close": abs(error) <= WITHIN
                            or (wide and low <= c["predicted_s"] <= high),
                        }
                    )
    return rows, choices


def print_table(rows: list[dict[str, Any]], choices: list[dict[str, Any]]) -> None:
    """The predictions beside the measured median and range, then the auto choices."""
    print(f"\n{'setting':18}{'model':6}{'candidate':28}{'predicted ms (per repeat)':>30}"
          f"{'measured median [range]':>28}{'errors':>22}")  # fmt: skip
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault((r["setting"], r["model"], r["candidate"]), []).append(r)
    for (setting, model, candidate), rs in grouped.items():
        preds = " ".join(f"{r['predicted_s'] * 1e3:.0f}" for r in rs)
        low, high = rs[0]["measured_range_s"]
        got = f"{rs[0]['measured_median_s'] * 1e3:.0f} [{low * 1e3:.0f}-{high * 1e3:.0f}]"
        errors = " ".join(f"{r['error']:+.0%}" for r in rs)
        print(f"{setting:18}{model:6}{candidate:28}{preds:>30}{got:>28}{errors:>22}")
    if rows:
        within = sum(r["within"] for r in rows) / len(rows)
        close = sum(r["close"] for r in rows) / len(rows)
        print(f"\n{len(rows)} predictions: {within:.0%} within {WITHIN:.0%} of the measured "
              f"median; {close:.0%} within it or inside a range wider than that")  # fmt: skip
    print(f"\n{'setting':18}{'model':6}{'repeat':>7}  {'auto':28}{'best':28}"
          f"{'chosen/best':>12}{'auto/best':>10}")  # fmt: skip
    for c in choices:
        print(f"{c['setting']:18}{c['model']:6}{c['repeat']:>7}  {c['auto']:28}{c['best']:28}"
              f"{c['chosen_over_best']:12.3f}{c['auto_over_best']:10.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
