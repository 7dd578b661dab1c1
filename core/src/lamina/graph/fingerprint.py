"""A graph's fingerprint: sha256 of a canonical JSON description.

The description holds what makes two captures the same plan input: the capture method,
each node's op, target, output shapes and dtypes (in graph order), the parameters with
shapes and dtypes, the first-use order and the tied groups. Node names and devices are
left out: names may carry per-process counters, and ranks of one job sit on different
device indices. Every key is sorted and the separators fixed, so the text (and the hash)
is the same in every process and every run, whatever ``PYTHONHASHSEED`` is.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from lamina.graph.metadata import CapturedGraph

FINGERPRINT_VERSION = 1


def canonical_description(graph: CapturedGraph) -> str:
    """The canonical JSON text that :func:`fingerprint_of` hashes (``graph.fingerprint``
    itself and the fall-back reasons are not part of it)."""
    description: dict[str, Any] = {
        "version": FINGERPRINT_VERSION,
        "method": graph.method,
        "nodes": [
            [n.op, n.target, [list(s) for s in n.shapes], list(n.dtypes)] for n in graph.nodes
        ],
        "params": [
            [p, list(graph.param_shapes[p]), graph.param_dtypes[p]] for p in graph.param_names
        ],
        "first_use": list(graph.first_use_order),
        "tied": [list(group) for group in graph.tied],
    }
    return json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def fingerprint_of(graph: CapturedGraph) -> str:
    """sha256 hex digest of :func:`canonical_description`."""
    return hashlib.sha256(canonical_description(graph).encode("ascii")).hexdigest()
