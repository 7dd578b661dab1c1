"""An emulated multi-host cluster on one machine: network namespaces joined by shaped
links, each host running its share of a job through the SLURM launch path."""

from lamina.emulate.cluster import EmulateOptions, run_emulated, task_environments
from lamina.emulate.links import LinkSpec, parse_link
from lamina.emulate.netns import EmulatedNetwork, ours, remove_stale

__all__ = [
    "EmulateOptions",
    "EmulatedNetwork",
    "LinkSpec",
    "ours",
    "parse_link",
    "remove_stale",
    "run_emulated",
    "task_environments",
]
