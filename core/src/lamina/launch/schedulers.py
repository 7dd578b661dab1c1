"""Where this process sits in a multi-node job, read from the scheduler's environment.

``lamina run`` turns what SLURM or a Kubernetes PyTorchJob put in the environment into
torchrun's static rendezvous: ``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port`` (and ``--nproc-per-node 1`` when the scheduler starts one task per
rank). The rank order is the scheduler's: with a static rendezvous torchrun numbers the
ranks ``node_rank * nproc_per_node + local_rank``, so a SLURM job with one task per rank
keeps ``SLURM_PROCID`` as the global rank, also when ``--distribution=cyclic`` spreads
consecutive ranks over hosts.

- **SLURM** (``srun ... lamina run ...`` inside an allocation): with one task per node,
  each task is one torchrun agent, node rank ``SLURM_NODEID`` of ``SLURM_NNODES``, and
  ``--nproc-per-node`` is the user's; with several tasks on this node, each task is one
  rank, node rank ``SLURM_PROCID`` of ``SLURM_NTASKS``. The rendezvous host is the first
  of ``SLURM_JOB_NODELIST``, the port ``$MASTER_PORT`` or one derived from the job id.
- **Kubernetes**, Kubeflow PyTorchJob: each pod has ``MASTER_ADDR``, ``MASTER_PORT``,
  ``WORLD_SIZE`` (pods) and ``RANK`` (this pod). The training operator's TrainJob sets
  torchrun's own ``PET_*`` variables instead, which torchrun reads itself: nothing to do.

Torchrun flags given on the command line always win over the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lamina.errors import ConfigError
from lamina.launch.nodelist import expand_nodelist, expand_task_counts

#: Ports derived from a SLURM job id: ``BASE_PORT + job_id % PORT_SPAN``.
BASE_PORT, PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class NodeLaunch:
    """One torchrun agent's place in a multi-node job (a static rendezvous)."""

    #: Who said so: ``"slurm"`` or ``"kubernetes"``.
    source: str
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    #: Ranks this agent starts; None: the user's ``--nproc-per-node``.
    nproc_per_node: int | None = None
    #: Every host of the job, in the scheduler's order (SLURM only).
    hosts: tuple[str, ...] = ()

    def torchrun_flags(self, given: set[str]) -> list[str]:
        """torchrun flags for what the user did not give (``given``: argparse dests)."""
        values: list[tuple[str, str, object]] = [
            ("nnodes", "--nnodes", self.nnodes),
            ("node_rank", "--node-rank", self.node_rank),
            ("master_addr", "--master-addr", self.master_addr),
            ("master_port", "--master-port", self.master_port),
        ]
        if self.nproc_per_node is not None:
            values.append(("nproc_per_node", "--nproc-per-node", self.nproc_per_node))
        flags: list[str] = []
        for dest, flag, value in values:
            if dest not in given:
                flags += [flag, str(value)]
        return flags

    def describe(self) -> str:
        """One line for the log: where this agent sits."""
        ranks = f"{self.nproc_per_node} rank(s)" if self.nproc_per_node else "its ranks"
        return (
            f"{self.source}: node {self.node_rank} of {self.nnodes} starts {ranks}; "
            f"rendezvous {self.master_addr}:{self.master_port}"
        )


def _int(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; run under the scheduler") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}; run under the scheduler")
    return value


def _port(env: Mapping[str, str], default: int) -> int:
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT", 1)
        if port > 65535:
            raise ConfigError(f"MASTER_PORT={port} is not a TCP port; use 1-65535")
        return port
    return default


def from_slurm(env: Mapping[str, str]) -> NodeLaunch | None:
    """The SLURM job step this process runs in, or None outside one."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job or "SLURM_PROCID" not in env or "SLURM_NODEID" not in env:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = expand_nodelist(nodelist)
    nnodes = _int(env, "SLURM_NNODES" if "SLURM_NNODES" in env else "SLURM_JOB_NUM_NODES", 1)
    if nnodes != len(hosts):
        raise ConfigError(
            f"SLURM_NNODES={nnodes} but SLURM_JOB_NODELIST={nodelist!r} names {len(hosts)} "
            "host(s); run lamina under srun, which sets both"
        )
    node_id = _int(env, "SLURM_NODEID")
    if node_id >= nnodes:
        raise ConfigError(f"SLURM_NODEID={node_id} is outside SLURM_NNODES={nnodes}")
    if "SLURM_NTASKS_PER_NODE" in env:
        on_this_node = _int(env, "SLURM_NTASKS_PER_NODE", 1)
    else:
        counts = expand_task_counts(env.get("SLURM_TASKS_PER_NODE", "1"))
        on_this_node = counts[node_id] if node_id < len(counts) else counts[-1]
    port = _port(
        env,
        BASE_PORT
        + _int(env, "SLURM_JOB_ID" if "SLURM_JOB_ID" in env else "SLURM_JOBID") % PORT_SPAN,
    )
    if on_this_node == 1:  # one torchrun agent per node
        return NodeLaunch("slurm", nnodes, node_id, hosts[0], port, None, tuple(hosts))
    tasks = _int(env, "SLURM_NTASKS", 1)
    proc = _int(env, "SLURM_PROCID")
    if proc >= tasks:
        raise ConfigError(f"SLURM_PROCID={proc} is outside SLURM_NTASKS={tasks}")
    return NodeLaunch("slurm", tasks, proc, hosts[0], port, 1, tuple(hosts))


def from_kubernetes(env: Mapping[str, str]) -> NodeLaunch | None:
    """A Kubeflow PyTorchJob pod (``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``
    set for the pod, not inside a torchrun rank), or None."""
    needed = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    if not all(env.get(name) for name in needed) or "LOCAL_RANK" in env:
        return None  # not a pod's environment (or already inside a rank)
    pods = _int(env, "WORLD_SIZE", 1)
    pod = _int(env, "RANK")
    if pod >= pods:
        raise ConfigError(f"RANK={pod} is outside WORLD_SIZE={pods}; check the PyTorchJob")
    return NodeLaunch("kubernetes", pods, pod, env["MASTER_ADDR"], _port(env, 29500))


def detect(env: Mapping[str, str]) -> NodeLaunch | None:
    """This process's place from SLURM, else a PyTorchJob pod; None for neither (a
    single node, or torchrun's ``PET_*`` variables, which torchrun reads itself)."""
    return from_slurm(env) or from_kubernetes(env)
