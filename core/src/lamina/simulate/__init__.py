"""What-if simulation: a training step's communication time and per-rank memory on a
declared cluster (up to 4096 devices) that is not there.

:mod:`lamina.simulate.cluster` reads the cluster file (hosts, devices per host, the
intra-host link, the NICs) and builds the :class:`~lamina.comm.cost.CostModel` of it;
:mod:`lamina.simulate.groups` maps each mesh axis to a simulated group on it,
:mod:`lamina.simulate.timing` costs each collective of an execution plan on its group,
:mod:`lamina.simulate.memory` applies the ZeRO memory formulas,
:mod:`lamina.simulate.report` holds the prediction with its report and assumptions,
:mod:`lamina.simulate.step` prices a whole step over a plan's edges from the price of
each node (what ``"auto"`` ranks its candidates by), and
:mod:`lamina.simulate.predict` wires them together. ``lamina plan --simulate
CLUSTER.json SCRIPT`` captures the plan and prints the prediction.
"""

from __future__ import annotations

from lamina.simulate.cluster import (
    MAX_DEVICES,
    Cluster,
    ClusterLink,
    cluster_from_dict,
    load_cluster,
)
from lamina.simulate.groups import PhaseTime
from lamina.simulate.memory import ADAMW_BYTES_PER_PARAM, MemoryEstimate, estimate_memory
from lamina.simulate.predict import predict
from lamina.simulate.report import StepPrediction
from lamina.simulate.timing import CollectiveTime

__all__ = [
    "ADAMW_BYTES_PER_PARAM",
    "MAX_DEVICES",
    "Cluster",
    "ClusterLink",
    "CollectiveTime",
    "MemoryEstimate",
    "PhaseTime",
    "StepPrediction",
    "cluster_from_dict",
    "estimate_memory",
    "load_cluster",
    "predict",
]
