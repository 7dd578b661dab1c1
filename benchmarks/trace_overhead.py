"""Overhead of the collective trace recorder on lamina DP, traced vs untraced, interleaved.

Two gloo ranks, one thread each, the workloads of ``_interleaved.py`` (the examples' GPT
at benchmark size, and the MLP). Both variants are lamina DP models in the same
processes; one process-wide recorder is switched on for the traced variant's blocks and
off for the other's, so the only difference is the recording itself (a sequence
number, two timestamps and a future callback per collective, two spans per step). The
table reports median step times and traced/untraced. Run it as::

    python benchmarks/trace_overhead.py        # re-launches itself under torchrun, 2 ranks
"""

from __future__ import annotations

from typing import Any

from torch import nn

import lamina
from _interleaved import add_ratios, base_parser, relaunch_under_torchrun, report, run_interleaved
from lamina.trace import TraceRecorder, get_recorder, start

VARIANTS = ("traced", "untraced")
PAIRS = (("traced", "untraced"),)


class _Switch(nn.Module):
    """Turns the process's recorder on or off before each forward of ``inner``."""

    def __init__(self, inner: nn.Module, enabled: bool) -> None:
        super().__init__()
        self.inner = inner
        self.enabled = enabled

    def forward(self, *args: Any) -> Any:
        recorder = get_recorder()
        assert recorder is not None
        recorder.enabled = self.enabled
        return self.inner(*args)


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "trace_overhead.json").parse_args()
    relaunch_under_torchrun(__file__)

    def wrap(variant: str, model: nn.Module) -> nn.Module:
        runtime = lamina.current()
        assert runtime is not None
        if get_recorder() is None:  # in memory only: the ring is bounded, nothing written
            start(TraceRecorder(runtime.rank, runtime.world_size, None))
        return _Switch(lamina.distribute(model, "dp"), variant == "traced")

    results = run_interleaved(args, VARIANTS, wrap)
    runtime = lamina.current()
    if runtime is not None and runtime.is_main:
        recorder = get_recorder()
        add_ratios(results, PAIRS)
        extra = {"events_recorded": recorder.recorded if recorder else 0}
        report("trace_overhead", results, VARIANTS, PAIRS, args, extra)
    lamina.shutdown()


if __name__ == "__main__":
    main()
