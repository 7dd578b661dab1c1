"""An expert-parallel run's load per rank, read from its trace: :func:`expert_load`.

Every token exchange of an MoE layer is recorded under its plan node with the bytes
this rank handed over: ``moe.<i>.tokens`` what it sent to the experts (its own tokens'
assignments), ``moe.<i>.results`` what it sent back (the assignments its experts
computed, from every rank). So per step and layer, the results' bytes of each rank are
its experts' load, and their busiest over their mean is the layer's imbalance: what the
slowest rank of each exchange makes the others wait for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lamina.trace.events import RankTrace

_NODE = re.compile(r"(?:^|\.)moe\.(\d+)\.(tokens|results)$")


@dataclass(frozen=True)
class ExpertLoad:
    """One MoE layer in one step: bytes each rank sent to the experts and computed."""

    step: int
    layer: int
    sent: dict[int, int]
    computed: dict[int, int]

    @property
    def imbalance(self) -> float:
        """The busiest rank's computed bytes over the mean (1.0: even; 0: none)."""
        values = list(self.computed.values())
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean else 0.0

    def to_json(self) -> dict[str, Any]:
        """Plain data (bytes by rank)."""
        return {
            "step": self.step,
            "layer": self.layer,
            "sent": {str(r): b for r, b in sorted(self.sent.items())},
            "computed": {str(r): b for r, b in sorted(self.computed.items())},
            "imbalance": self.imbalance,
        }


def expert_load(traces: dict[int, RankTrace]) -> list[ExpertLoad]:
    """Every step's and MoE layer's load (see the module); empty for a run without ep."""
    found: dict[tuple[int, int], tuple[dict[int, int], dict[int, int]]] = {}
    for rank, trace in traces.items():
        for event in trace.collectives:
            match = _NODE.search(event.node)
            if match is None:
                continue
            sent, computed = found.setdefault((event.step, int(match.group(1))), ({}, {}))
            into = sent if match.group(2) == "tokens" else computed
            into[rank] = into.get(rank, 0) + event.bytes
    return [
        ExpertLoad(step, layer, sent, computed)
        for (step, layer), (sent, computed) in sorted(found.items())
    ]


def load_lines(loads: list[ExpertLoad]) -> list[str]:
    """The report's lines: per MoE layer, the last step's load per rank and the
    imbalance over every step (median and worst)."""
    if not loads:
        return []
    last = max(load.step for load in loads)
    lines = ["expert load (bytes each rank's experts computed; busiest over mean):"]
    for layer in sorted({load.layer for load in loads}):
        mine = [load for load in loads if load.layer == layer]
        ratios = sorted(load.imbalance for load in mine)
        shown = next((load for load in mine if load.step == last), mine[-1])
        ranks = " ".join(f"r{r}={b}" for r, b in sorted(shown.computed.items()))
        lines.append(
            f"  MoE layer {layer}: step {shown.step}: {ranks}; imbalance median "
            f"{ratios[len(ratios) // 2]:.2f}, worst {ratios[-1]:.2f} over {len(mine)} step(s)"
        )
    return lines


__all__ = ["ExpertLoad", "expert_load", "load_lines"]
