"""Multi-node launch: where a torchrun agent sits in a job, from the scheduler's
environment (SLURM, Kubernetes), as torchrun flags. Depends on nothing else in lamina."""

from lamina.launch.nodelist import expand_nodelist, expand_task_counts
from lamina.launch.schedulers import NodeLaunch, detect, from_kubernetes, from_slurm

__all__ = [
    "NodeLaunch",
    "detect",
    "expand_nodelist",
    "expand_task_counts",
    "from_kubernetes",
    "from_slurm",
]
