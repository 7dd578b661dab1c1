"""The automatic choice: ``lamina.distribute(model, "auto")``.

:mod:`lamina.auto.candidates` lists the ways to distribute a model on the mesh,
:mod:`lamina.auto.measure` times the model on the device, :mod:`lamina.auto.comm` costs
each collective (timed on the job, or on a declared cluster),
:mod:`lamina.auto.predict` predicts each candidate's step time and memory per rank,
:mod:`lamina.auto.ranking` ranks them, and :mod:`lamina.auto.choose` wires them to
``lamina.distribute``. ``lamina plan --auto --explain SCRIPT`` prints the ranking.
"""

from __future__ import annotations

from lamina.auto.candidates import Candidate, Use, candidates_for
from lamina.auto.choose import AUTO, AutoChoice, AutoOptions, RankedOnly, distribute_auto
from lamina.auto.predict import CandidatePrediction, predict_candidate
from lamina.auto.ranking import Ranked, Ranking, rank_candidates

__all__ = [
    "AUTO",
    "AutoChoice",
    "AutoOptions",
    "Candidate",
    "CandidatePrediction",
    "Ranked",
    "RankedOnly",
    "Ranking",
    "Use",
    "candidates_for",
    "distribute_auto",
    "predict_candidate",
    "rank_candidates",
]
