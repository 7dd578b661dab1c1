"""``lamina trace report`` and ``lamina trace diagnose``: read a ``LAMINA_TRACE`` folder.

- ``report`` prints bandwidth per op and size, exposed vs hidden communication per
  step and the entry skew between ranks; it writes ``DIR/trace.json`` (Chrome/Perfetto)
  and ``DIR/timeline.png`` (one step) and prints their paths. ``--json`` prints only the
  report as JSON and writes a file only when ``--chrome`` or ``--plot`` names one.
- ``diagnose`` explains a hang from the watchdog dumps (exit 0 when nothing is wrong).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from lamina.errors import ConfigError
from lamina.trace.analysis import TraceReport, build_report
from lamina.trace.events import read_dir
from lamina.trace.expert_view import load_lines
from lamina.trace.export import save_chrome_trace
from lamina.units import format_bytes

#: Step rows shown in the terminal (the latest ones); ``--json`` has them all.
MAX_STEP_ROWS = 20


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.2f}"


def _gbs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_report(report: TraceReport, console: Console) -> None:
    """Print the report as tables."""
    t = report.totals
    console.print(
        f"[bold]trace[/bold] {report.directory}: {t['ranks']} rank(s), {t['steps']} step(s), "
        f"{t['collectives']} collective(s) ({t['events']} rank events), "
        f"{format_bytes(t['bytes'])} moved"
        + (f", [red]{t['pending']} pending[/red]" if t["pending"] else "")
        + (f", [yellow]{t['dropped']} dropped from the ring[/yellow]" if t["dropped"] else ""),
        soft_wrap=True,
    )
    ops = Table(
        title="collectives by op and size (medians over rank events; GB/s)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("op", "size", "calls", "total ms", "med ms", "algbw", "busbw"):
        left = column in ("op", "size")
        ops.add_column(column, justify="left" if left else "right", no_wrap=left)
    for r in report.ops:
        ops.add_row(
            r.op,
            r.size_class,
            str(r.calls),
            f"{r.total_s * 1e3:.2f}",
            f"{r.median_s * 1e3:.3f}",
            _gbs(r.algbw_gbs),
            _gbs(r.busbw_gbs),
        )
    console.print(ops)
    steps = Table(
        title="communication per step (ms; mean over ranks, wall = slowest rank)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("step", "wall", "comm", "hidden (%)", "exposed (%)", "worst rank"):
        steps.add_column(column, justify="right", no_wrap=True)
    for s in report.steps[-MAX_STEP_ROWS:]:
        steps.add_row(
            str(s.step),
            _ms(s.wall_ns),
            _ms(s.comm_ns),
            f"{_ms(s.hidden_ns)} ({s.hidden_pct:.0f}%)",
            f"{_ms(s.exposed_ns)} ({s.exposed_pct:.0f}%)",
            f"{s.worst_rank}: {_ms(s.worst_exposed_ns)}",
        )
    console.print(steps)
    if len(report.steps) > MAX_STEP_ROWS:
        console.print(f"  ({len(report.steps) - MAX_STEP_ROWS} earlier step(s) in --json)")
    _render_pipeline(report, console)
    for line in load_lines(report.experts):
        console.print(line, soft_wrap=True)
    _render_skew(report, console)


def _render_pipeline(report: TraceReport, console: Console) -> None:
    """A pipelined run's steps, one row per rank: the schedule, its stages' compute, the
    bubble (the rest of the schedule) and the gradient sync after it."""
    if not report.pipeline:
        return
    table = Table(
        title="pipeline per step and rank (ms; bubble: the schedule's time not computing)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("step", "rank", "schedule", "compute", "bubble", "gradient sync"):
        table.add_column(column, justify="right", no_wrap=True)
    steps = sorted({row.step for row in report.pipeline})[-MAX_STEP_ROWS:]
    for row in sorted(report.pipeline, key=lambda r: (r.step, r.rank)):
        if row.step in steps:
            table.add_row(
                str(row.step),
                str(row.rank),
                _ms(row.schedule_ns),
                _ms(row.compute_ns),
                f"{_ms(row.schedule_ns - row.compute_ns)} ({100 * row.bubble:.0f}%)",
                _ms(row.sync_ns),
            )
    console.print(table)


def _render_skew(report: TraceReport, console: Console) -> None:
    skew = report.stragglers
    if not skew.collectives:
        console.print("entry skew: no collective was recorded by two or more ranks")
        return
    console.print(
        f"[bold]entry skew[/bold] over {skew.collectives} collective(s): median "
        f"{_ms(skew.median_skew_ns)} ms, max {_ms(skew.max_skew_ns)} ms"
    )
    ranks = Table(box=box.SIMPLE_HEAD)
    for column in ("rank", "collectives", "entered last", "mean lateness ms"):
        ranks.add_column(column, justify="right")
    for r in skew.ranks:
        ranks.add_row(str(r.rank), str(r.collectives), str(r.times_last), _ms(r.mean_lateness_ns))
    console.print(ranks)
    for w in skew.worst:
        if w.skew_ns:
            console.print(
                f"  #{w.seq} {w.node}: rank {w.last_rank} entered {_ms(w.skew_ns)} ms "
                "after the first",
                soft_wrap=True,
            )
    if skew.stragglers:
        names = ", ".join(str(r) for r in skew.stragglers)
        console.print(f"[red]straggler rank(s): {names}[/red] (entered last most often, late)")
    else:
        console.print("[green]no straggler[/green]: no rank is consistently and clearly late")


def report_command(args: argparse.Namespace) -> int:
    """``lamina trace report DIR``."""
    traces = read_dir(args.directory)
    report = build_report(traces, str(args.directory))
    directory = Path(args.directory)
    console = Console()
    chrome = args.chrome or (None if args.json else directory / "trace.json")
    written: list[Path] = []
    if chrome is not None:
        written.append(save_chrome_trace(traces, chrome))
    plot = args.plot or (None if args.json or args.no_plot else directory / "timeline.png")
    note = ""
    if plot is not None:
        from lamina.trace.timeline import plot_step

        try:
            written.append(plot_step(traces, args.step, plot))
        except ConfigError as exc:
            if args.plot or args.step is not None:  # asked for: an error
                raise
            note = f"timeline not drawn: {exc}"
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
        return 0
    render_report(report, console)
    for path in written:
        console.print(f"wrote {path}", soft_wrap=True)
    if note:
        console.print(f"[yellow]{note}[/yellow]", soft_wrap=True)
    return 0


def diagnose_command(args: argparse.Namespace) -> int:
    """``lamina trace diagnose DIR``: exit 0 when the trace shows nothing wrong, else 1."""
    from lamina.trace.diagnose import diagnose

    diagnosis = diagnose(args.directory)
    if args.json:
        print(json.dumps(diagnosis.to_json(), indent=2, sort_keys=True))
    else:
        for line in diagnosis.lines():
            print(line)
    return 0 if diagnosis.ok else 1


def add_trace_parser(subparsers: Any) -> None:
    """Register ``trace report`` and ``trace diagnose`` on the ``lamina`` subcommands."""
    trace = subparsers.add_parser(
        "trace",
        help="read a collective trace folder (LAMINA_TRACE=DIR)",
        description="Analyse the per-rank collective traces lamina wrote into DIR.",
    )
    sub = trace.add_subparsers(dest="trace_command", required=True, metavar="COMMAND")
    report = sub.add_parser(
        "report",
        help="bandwidth, exposed communication and stragglers; Chrome trace and timeline",
        description="Print bandwidth per op and size, exposed vs hidden communication per "
        "step and the entry skew between ranks; write DIR/trace.json (open it in Perfetto "
        "or chrome://tracing) and DIR/timeline.png.",
    )
    report.add_argument("directory", metavar="DIR", help="the LAMINA_TRACE folder")
    report.add_argument(
        "--json",
        action="store_true",
        help="print only the report as JSON (writes no file unless --chrome or --plot names one)",
    )
    report.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="step to draw (default: the last step complete on every rank)",
    )
    report.add_argument(
        "--plot", default=None, metavar="PATH", help="timeline PNG path (default DIR/timeline.png)"
    )
    report.add_argument("--no-plot", action="store_true", help="draw no timeline")
    report.add_argument(
        "--chrome", default=None, metavar="PATH", help="Chrome trace path (default DIR/trace.json)"
    )
    report.set_defaults(func=report_command)
    diagnose = sub.add_parser(
        "diagnose",
        help="explain a hang from the watchdog dumps",
        description="Read the rank traces in DIR (hang dumps first) and say what went "
        "wrong, if anything; exit 0 when nothing is wrong, 1 otherwise.",
    )
    diagnose.add_argument("directory", metavar="DIR", help="the LAMINA_TRACE folder")
    diagnose.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    diagnose.set_defaults(func=diagnose_command)
