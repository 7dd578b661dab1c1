"""What-if simulation: a training step's communication time and per-rank memory on a
declared cluster (up to 4096 devices) that is not there.

:mod:`lamina.simulate.cluster` reads the cluster file (hosts, devices per host, the
intra-host link, the NICs) and builds the :class:`~lamina.comm.cost.CostModel` of it;
:mod:`lamina.simulate.predict` costs each collective of an execution plan on it and
applies the ZeRO memory formulas. ``lamina plan --simulate CLUSTER.json SCRIPT`` captures
the plan and prints the prediction.
"""

from __future__ import annotations

from lamina.simulate.cluster import (
    MAX_DEVICES,
    Cluster,
    ClusterLink,
    cluster_from_dict,
    load_cluster,
)
from lamina.simulate.predict import (
    ADAMW_BYTES_PER_PARAM,
    CollectiveTime,
    MemoryEstimate,
    PhaseTime,
    StepPrediction,
    estimate_memory,
    predict,
)

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
