"""The ranking of the candidates and the choice: :func:`rank_candidates`.

Every candidate's step is priced from its plan and its memory per rank predicted; one
that cannot run the model (or whose strategies refuse it while planning), or whose
predicted memory per rank does not fit the device's memory less a margin, is rejected
with the reason.
The fastest candidate left is chosen, except that a candidate listed earlier (simpler:
fewer strategies, nothing sharded, nothing lossy) predicted within
:data:`PREFER_SIMPLER_WITHIN` of it is chosen instead: closer than that, the prediction
cannot tell them apart, and the simpler one has less that the model leaves out. It
comes first in the ranking, the others after it by predicted time. When none fits,
:meth:`Ranking.choice` is a one-line error naming the smallest predicted footprint and
the device's memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lamina.auto.candidates import Candidate
from lamina.auto.measure import ModelProfile
from lamina.auto.predict import CandidatePrediction, NotApplicable, fits, predict_memory
from lamina.errors import ConfigError
from lamina.simulate.step import PricedStep

#: Share of the device's memory kept free by default.
MEMORY_MARGIN = 0.1
#: Predicted steps this close to the fastest count as a tie, won by the simpler candidate:
#: about the median prediction error measured per setting (``benchmarks/
#: simulate_accuracy.py``: -1.6% to -4.8%). At 10%, a simpler candidate predicted 8%
#: slower was chosen where it measured 19-25% slower (the GPT across 200 Mbit/s: dp over
#: pp(inter)+dp(intra)).
PREFER_SIMPLER_WITHIN = 0.03


@dataclass(frozen=True)
class Ranked:
    """One candidate with its prediction, or the reason it was rejected."""

    candidate: Candidate
    prediction: CandidatePrediction | None
    rejected: str = ""

    def to_json(self) -> dict[str, Any]:
        """Plain data."""
        return {
            **self.candidate.to_json(),
            "prediction": self.prediction.to_json() if self.prediction else None,
            "rejected": self.rejected,
        }


@dataclass(frozen=True)
class Ranking:
    """Every candidate, fastest first, the rejected ones last."""

    entries: tuple[Ranked, ...]
    device_memory: int | None
    margin: float
    where: str

    @property
    def chosen(self) -> Ranked | None:
        """The fastest candidate that fits (None: none does)."""
        return next((e for e in self.entries if not e.rejected), None)

    def choice(self) -> Ranked:
        """The chosen candidate; a one-line ConfigError when none fits."""
        chosen = self.chosen
        if chosen is not None:
            return chosen
        sized = [e for e in self.entries if e.prediction is not None]
        if not sized:
            reasons = "; ".join(f"{e.candidate.label}: {e.rejected}" for e in self.entries)
            raise ConfigError(f"strategy 'auto': no candidate can run this model ({reasons})")
        smallest = min(sized, key=lambda e: e.prediction.memory_bytes if e.prediction else 0)
        assert smallest.prediction is not None
        raise ConfigError(
            f"strategy 'auto': the model fits no candidate's memory: the smallest predicted "
            f"footprint is {_gib(smallest.prediction.memory_bytes)} per rank "
            f"({smallest.candidate.label}) against {_gib(self.device_memory or 0)} of device "
            f"memory ({self.margin:.0%} kept free); use more ranks, a smaller batch or a "
            "smaller model"
        )

    def table(self) -> str:
        """The ranking as lines (:func:`render_ranking`)."""
        return render_ranking(self.to_json())

    def to_json(self) -> dict[str, Any]:
        """Plain data."""
        chosen = self.chosen
        return {
            "chosen": chosen.candidate.label if chosen else None,
            "device_memory": self.device_memory,
            "margin": self.margin,
            "where": self.where,
            "candidates": [e.to_json() for e in self.entries],
        }

    def record(self) -> str:
        """The ranking as one JSON line (what the plan keeps)."""
        return json.dumps(self.to_json(), sort_keys=True)


def render_ranking(data: dict[str, Any]) -> str:
    """A ranking's JSON (:meth:`Ranking.to_json`) as lines: rank, candidate, predicted
    step with the interval the measured spread gives, memory per rank, and the verdict
    (chosen, how much slower, or why rejected)."""
    rows = [f"{'#':>2}  {'candidate':34}{'step ms':>10}{'interval':>15}{'memory':>11}  verdict"]
    entries = data["candidates"]
    best = next(
        (e["prediction"]["step_s"] for e in entries if not e["rejected"] and e["prediction"]),
        None,
    )
    for i, e in enumerate(entries, 1):
        p = e["prediction"]
        step = f"{p['step_s'] * 1e3:10.1f}" if p else f"{'-':>10}"
        interval = p.get("interval_s") if p else None
        step += f"{_interval(interval):>15}"
        mem = f"{_gib(p['memory_bytes']):>11}" if p else f"{'-':>11}"
        if e["rejected"]:
            verdict = f"rejected: {e['rejected']}"
        elif e["label"] == data["chosen"]:
            verdict = "chosen"
        elif p and best:
            ratio = p["step_s"] / best
            verdict = f"{ratio:.2f}x the chosen"
            if ratio < 1:
                verdict += f" (within {PREFER_SIMPLER_WITHIN:.0%}: the simpler one is chosen)"
        else:
            verdict = ""
        rows.append(f"{i:>2}  {e['label']:34}{step}{mem}  {verdict}")
    memory = data["device_memory"]
    shown = "unknown" if memory is None else _gib(memory)
    rows.append(f"device memory {shown} per rank, {data['margin']:.0%} kept free; {data['where']}")
    return "\n".join(rows)


def rank_candidates(
    candidates: Sequence[Candidate],
    profile: ModelProfile,
    price: Callable[[Candidate], PricedStep],
    *,
    device_memory: int | None,
    margin: float = MEMORY_MARGIN,
    where: str = "",
    global_rows: int | None = None,
) -> Ranking:
    """Rank ``candidates`` with ``global_rows`` rows per step (default: the profile's
    rows on every rank; see the module). ``price``: a candidate's step priced from its
    plan (:func:`lamina.simulate.step.price_step`); a ConfigError from it (its
    strategies refuse the model) rejects the candidate. The memory per rank is
    :func:`~lamina.auto.predict.predict_memory`'s."""
    entries = []
    for candidate in candidates:
        try:
            memory = predict_memory(candidate, profile, global_rows)
            priced = price(candidate)
        except (NotApplicable, ConfigError) as exc:
            entries.append(Ranked(candidate, None, f"not applicable: {exc}"))
            continue
        prediction = CandidatePrediction(
            priced.step_s,
            memory.memory_bytes,
            dict(priced.parts),
            dict(memory.memory_parts),
            priced.collectives,
            priced.interval_s,
        )
        if not fits(prediction, device_memory, margin):
            reason = (
                f"needs {_gib(prediction.memory_bytes)} per rank, over "
                f"{1 - margin:.0%} of {_gib(device_memory or 0)}"
            )
            entries.append(Ranked(candidate, prediction, reason))
            continue
        entries.append(Ranked(candidate, prediction))
    order = {id(e): i for i, e in enumerate(entries)}
    fitting = [e for e in entries if not e.rejected and e.prediction is not None]
    chosen: Ranked | None = None
    if fitting:
        fastest = min(e.prediction.step_s for e in fitting if e.prediction)
        chosen = min(
            (
                e
                for e in fitting
                if e.prediction and e.prediction.step_s <= fastest * (1 + PREFER_SIMPLER_WITHIN)
            ),
            key=lambda e: order[id(e)],
        )
    entries.sort(
        key=lambda e: (
            e is not chosen,
            bool(e.rejected),
            e.prediction.step_s if e.prediction and not e.rejected else 0.0,
            order[id(e)],
        )
    )
    return Ranking(tuple(entries), device_memory, margin, where)


def _interval(interval: list[float] | None) -> str:
    """``135.2-150.9`` (ms), or ``-`` without one."""
    if not interval:
        return "-"
    return f"{interval[0] * 1e3:.1f}-{interval[1] * 1e3:.1f}"


def _gib(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


__all__ = [
    "MEMORY_MARGIN",
    "PREFER_SIMPLER_WITHIN",
    "Ranked",
    "Ranking",
    "rank_candidates",
    "render_ranking",
]
