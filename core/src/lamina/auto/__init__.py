"""The automatic choice: ``lamina.distribute(model, "auto")``.

:mod:`lamina.auto.candidates` lists the ways to distribute a model on the mesh,
:mod:`lamina.auto.measure` times the model on the device, :mod:`lamina.auto.comm` costs
each collective (timed on the job, or on a declared cluster),
:mod:`lamina.auto.plans` makes each candidate's plan without a collective (and
:mod:`lamina.auto.cluster_plans` as a rank of a declared cluster),
:mod:`lamina.auto.pricing` prices its nodes for :func:`lamina.simulate.step.price_step`,
:mod:`lamina.auto.predict` predicts each candidate's memory per rank and whether it can
run the model at all,
:mod:`lamina.auto.ranking` ranks them, and :mod:`lamina.auto.choose` chooses: it returns
the choice (:class:`AutoChoice`, with the :class:`Distribution` that applies it), which
``lamina.distribute`` applies as strategies given by hand. ``lamina plan --auto
--explain SCRIPT`` prints the ranking.
"""

from __future__ import annotations

from lamina.auto.candidates import Candidate, Use, candidates_for
from lamina.auto.choose import (
    AUTO,
    AutoChoice,
    AutoOptions,
    Distribution,
    RankedOnly,
    choose,
    rank_cluster,
)
from lamina.auto.predict import CandidatePrediction, predict_memory
from lamina.auto.ranking import Ranked, Ranking, rank_candidates

__all__ = [
    "AUTO",
    "AutoChoice",
    "AutoOptions",
    "Candidate",
    "CandidatePrediction",
    "Distribution",
    "Ranked",
    "RankedOnly",
    "Ranking",
    "Use",
    "candidates_for",
    "choose",
    "predict_memory",
    "rank_candidates",
    "rank_cluster",
]
