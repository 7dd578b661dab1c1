"""A picture of one training step: per rank, compute spans above its collectives.

Needs matplotlib (``pip install lamina-core[plot]``); drawn with the Agg canvas directly,
so the process's pyplot backend is left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lamina.errors import ConfigError
from lamina.trace.events import CollectiveEvent, RankTrace, SpanEvent
from lamina.trace.export import last_ns

#: Colors of the collective ops (others take the remaining palette in order).
OP_COLORS: dict[str, str] = {
    "all_reduce": "#1f77b4",
    "all_gather": "#2ca02c",
    "reduce_scatter": "#ff7f0e",
    "broadcast": "#9467bd",
    "all_to_all": "#d62728",
    "barrier": "#7f7f7f",
}
_SPARE = ["#8c564b", "#e377c2", "#bcbd22", "#17becf"]
COMPUTE_COLORS: dict[str, str] = {"forward": "#c6dbef", "backward": "#9ecae1"}
MAX_LANES = 4


def _pending(trace: RankTrace, step: int) -> bool:
    return any(e.end_ns is None for e in trace.collectives if e.step == step) or any(
        s.end_ns is None for s in trace.spans if s.step == step
    )


def _steps(trace: RankTrace) -> set[int]:
    return {e.step for e in trace.collectives} | {s.step for s in trace.spans}


def complete_steps(traces: dict[int, RankTrace]) -> list[int]:
    """Steps every rank recorded, with nothing left pending on any rank."""
    if not traces:
        return []
    common = set.intersection(*(_steps(t) for t in traces.values()))
    return sorted(s for s in common if not any(_pending(t, s) for t in traces.values()))


def _step_events(
    trace: RankTrace, step: int
) -> tuple[list[SpanEvent], list[CollectiveEvent], int | None]:
    spans = [s for s in trace.spans if s.step == step]
    colls = [e for e in trace.collectives if e.step == step]
    starts = [s.start_ns for s in spans if s.track == "step"]
    starts = starts or [s.start_ns for s in spans] + [e.issue_ns for e in colls]
    return spans, colls, min(starts) if starts else None


def _lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """A lane per interval (greedy, by start) so overlapping collectives sit side by side."""
    ends: list[float] = []
    lanes = [0] * len(intervals)
    for index in sorted(range(len(intervals)), key=lambda k: intervals[k]):
        start, end = intervals[index]
        free = [lane for lane, busy in enumerate(ends) if busy <= start]
        if free:
            lane = free[0]
        elif len(ends) < MAX_LANES:
            ends.append(end)
            lane = len(ends) - 1
        else:
            lane = min(range(len(ends)), key=ends.__getitem__)
        ends[lane] = max(ends[lane], end)
        lanes[index] = lane
    return lanes


def _ms(ns: int, origin: int) -> float:
    return (ns - origin) / 1e6


def _import_matplotlib() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(
            "install lamina-core[plot] (matplotlib) for the timeline picture"
        ) from None
    return Figure, FigureCanvasAgg, Patch


def plot_step(traces: dict[int, RankTrace], step: int | None, out: str | Path) -> Path:
    """Draw ``step`` (default: the last step complete on all ranks) into the PNG ``out``."""
    if not traces:
        raise ConfigError("the trace holds no rank; record one with LAMINA_TRACE=DIR")
    if step is None:
        complete = complete_steps(traces)
        if not complete:
            raise ConfigError("no step is complete on every rank; pass --step N to pick one")
        step = complete[-1]
    per_rank = {r: _step_events(t, step) for r, t in sorted(traces.items())}
    starts = [s for _, _, s in per_rank.values() if s is not None]
    if not starts:
        known = sorted(set.union(*(_steps(t) for t in traces.values())))
        raise ConfigError(
            f"step {step} is not in the trace; it holds steps {known[0]}..{known[-1]}"
            if known
            else "the trace holds no step; record one with LAMINA_TRACE=DIR"
        )
    Figure, FigureCanvasAgg, Patch = _import_matplotlib()
    origin = min(starts)
    ranks = len(per_rank)
    height = 200 + 120 * ranks  # pixels at 100 dpi: 70 above the axes, 60 below
    fig = Figure(figsize=(12, height / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.1, 60 / height, 0.87, 1 - 130 / height))
    colors = dict(OP_COLORS)
    bars: list[tuple[float, float, float, float, str, str, bool]] = []  # x, w, y, h, ...
    ticks: list[tuple[float, str]] = []
    for row, (rank, (spans, colls, _)) in enumerate(per_rank.items()):
        base = 2.0 * (ranks - 1 - row)
        ticks += [(base + 1.4, f"rank {rank} compute"), (base + 0.4, f"rank {rank} comm")]
        last = last_ns(traces[rank])

        for s in spans:
            if s.track == "compute":
                x0 = _ms(s.start_ns, origin)
                x1 = _ms(last if s.end_ns is None else s.end_ns, origin)
                color = COMPUTE_COLORS.get(s.name, "#dddddd")
                bars.append((x0, x1 - x0, base + 1, 0.8, color, s.name, s.end_ns is None))
        spans_ms = [
            (_ms(e.issue_ns, origin), _ms(last if e.end_ns is None else e.end_ns, origin))
            for e in colls
        ]
        lanes = _lanes(spans_ms)
        count = max(lanes, default=0) + 1
        for e, (x0, x1), lane in zip(colls, spans_ms, lanes, strict=True):
            if e.op not in colors:
                colors[e.op] = _SPARE[(len(colors) - len(OP_COLORS)) % len(_SPARE)]
            h = 0.8 / count
            bars.append((x0, x1 - x0, base + lane * h, h, colors[e.op], e.node, e.end_ns is None))
    right = max((x + w for x, w, *_ in bars), default=1.0) or 1.0
    ax.set_xlim(0, right * 1.01)
    ax.set_ylim(-0.2, 2.0 * ranks)
    px_per_ms = fig.get_figwidth() * fig.dpi * 0.87 / (right * 1.01)
    for x, w, y, h, color, label, pending in bars:
        ax.broken_barh(
            [(x, max(w, right * 1e-4))],
            (y, h),
            facecolors=color,
            edgecolors="#d62728" if pending else "none",
            hatch="//" if pending else None,
        )
        text = f"{label} (pending)" if pending else label
        if w * px_per_ms > 4.5 * len(text) + 6 and h >= 0.3:
            ink = "black" if color in COMPUTE_COLORS.values() else "white"
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=7, color=ink)
    ax.set_yticks([t for t, _ in ticks], [name for _, name in ticks], fontsize=8)
    ax.set_xlabel(f"milliseconds from the start of step {step}")
    ax.grid(axis="x", alpha=0.3)
    used = sorted({b[4] for b in bars})
    handles = [Patch(color=c, label=n) for n, c in COMPUTE_COLORS.items() if c in used]
    handles += [Patch(color=c, label=op) for op, c in colors.items() if c in used]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=8, fontsize=7)
    fig.suptitle(f"lamina trace: step {step} on {ranks} rank(s), {right:.1f} ms", fontsize=10)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
