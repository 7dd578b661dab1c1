"""The links of the job's cluster as the simulator takes them, calibrated on the job:
:func:`calibrated_links`."""

from __future__ import annotations

import lamina


def calibrated_links(runtime: lamina.Runtime) -> dict[str, dict[str, float]]:
    """The intra- and inter-host links calibrated on the job: gloo's own hierarchical
    phases timed at two sizes, a straight line through them per link class
    (:func:`lamina.comm.calibrate.calibrate`; collective)."""
    from lamina.comm.algorithms import AlgorithmGroups
    from lamina.comm.calibrate import calibrate
    from lamina.comm.cost import CostModel
    from lamina.comm.layout import HostLayout

    topology = runtime.topology
    groups = AlgorithmGroups(HostLayout.of(topology), runtime.rank, pg_backend="gloo")
    try:
        model = calibrate(
            groups,
            CostModel.from_topology(topology),
            device=runtime.device,
            sync=runtime.handle.synchronize,
        )
    finally:
        groups.close()
    return {
        name: {"bandwidth_gbps": cost.bandwidth_gbps, "latency_us": cost.alpha_s * 1e6}
        for name, cost in (("intra", model.intra), ("inter", model.inter))
    }
