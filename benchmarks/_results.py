"""Writing a benchmark's JSON: the run's context (date, versions, cores) and its results."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(benchmark: str, output: str, fields: dict[str, Any]) -> Path:
    """Write ``results/<output>``: ``benchmark``, when and where it ran, and ``fields``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / output
    payload = {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **fields,
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return path
