"""Run a job on an emulated cluster: every host's agents, through the SLURM launch path.

Each emulated host starts its share of the job as SLURM would: the variables of one
job step (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_NODEID``, ``SLURM_PROCID``,
...) are set, and ``lamina run`` turns them into torchrun's rendezvous on host 0
(:mod:`lamina.launch`). ``ordered`` starts one task per host, whose torchrun agent
starts the host's ranks (global ranks ``host * P + local``); ``interleaved`` starts one
task per rank, numbered round-robin across the hosts as ``srun --distribution=cyclic``
does (host ``h`` runs ranks ``h, h + H, h + 2H, ...``). gloo binds to the host's
``eth0``. The hosts share this machine's cores, so every rank gets
``OMP_NUM_THREADS=1`` unless the caller set it. Every agent's output is printed live,
prefixed with its host; the run is bounded in time, and the network is always torn down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lamina.emulate.faults import Fault, FaultInjector
from lamina.emulate.links import LinkSpec
from lamina.emulate.netns import EmulatedHost, EmulatedNetwork, check_privileges, remove_stale
from lamina.errors import ConfigError

RANK_ORDERS = ("ordered", "interleaved")
#: Variables of an outer launch that must not leak into the emulated hosts.
_OUTER = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)  # fmt: skip
#: Seconds the other agents get to end by themselves after one fails.
GRACE_S = 20.0
TAIL_LINES = 60


@dataclass(frozen=True)
class EmulateOptions:
    """What ``lamina emulate`` runs: ``command`` on ``hosts`` x ``nproc_per_host`` ranks."""

    hosts: int
    nproc_per_host: int
    link: LinkSpec
    command: tuple[str, ...]
    rank_order: str = "ordered"
    timeout_s: float = 600.0
    #: A fault to inject (lamina.emulate.faults), or None.
    fault: Fault | None = None

    def __post_init__(self) -> None:
        if self.nproc_per_host < 1:
            raise ConfigError(f"--nproc-per-host {self.nproc_per_host} must be >= 1")
        if self.rank_order not in RANK_ORDERS:
            raise ConfigError(f"--rank-order {self.rank_order!r} is not one of {RANK_ORDERS}")
        if not self.command:
            raise ConfigError("no command after --; e.g. lamina emulate ... -- train.py --steps 5")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout {self.timeout_s} must be > 0 seconds")


@dataclass
class Agent:
    """One launched task on one emulated host."""

    host: EmulatedHost
    label: str
    process: subprocess.Popen[bytes]
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None
    injector: FaultInjector | None = None


def command_argv(command: Sequence[str], nproc_per_node: int | None = None) -> list[str]:
    """What each task runs: a script goes through ``lamina run`` (the scheduler path,
    starting ``nproc_per_node`` ranks when given); a ``lamina ...`` command line runs as
    it is."""
    lamina = [sys.executable, "-m", "lamina.cli.main"]
    if command[0] == "lamina":
        return [*lamina, *command[1:]]
    script = command[0]
    if not os.path.isfile(script):
        raise ConfigError(f"script {script!r} does not exist; pass the path of a Python file")
    nproc = ["--nproc-per-node", str(nproc_per_node)] if nproc_per_node else []
    return [*lamina, "run", *nproc, *command]


def task_environments(options: EmulateOptions, job_id: int) -> list[tuple[int, dict[str, str]]]:
    """(host index, SLURM variables) of every task, in launch order."""
    hosts, per_host = options.hosts, options.nproc_per_host
    common = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": f"lamina-h[0-{hosts - 1}]" if hosts > 1 else "lamina-h0",
        "SLURM_NNODES": str(hosts),
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    tasks: list[tuple[int, dict[str, str]]] = []
    one_per_rank = options.rank_order == "interleaved" and per_host > 1
    for host in range(hosts):
        if not one_per_rank:
            tasks.append((host, {
                **common, "SLURM_NODEID": str(host), "SLURM_PROCID": str(host),
                "SLURM_NTASKS": str(hosts), "SLURM_NTASKS_PER_NODE": "1",
                "SLURM_LOCALID": "0",
            }))  # fmt: skip
            continue
        for local in range(per_host):
            tasks.append((host, {
                **common, "SLURM_NODEID": str(host), "SLURM_PROCID": str(local * hosts + host),
                "SLURM_NTASKS": str(hosts * per_host), "SLURM_NTASKS_PER_NODE": str(per_host),
                "SLURM_LOCALID": str(local),
            }))  # fmt: skip
    return tasks


def _read(agent: Agent) -> None:
    assert agent.process.stdout is not None
    for raw in iter(agent.process.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        agent.tail.append(line)
        print(f"[{agent.label}] {line}", flush=True)
        if agent.injector is not None:
            agent.injector.saw(line)


def _stop(agents: Sequence[Agent]) -> None:
    for agent in agents:
        if agent.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for agent in agents:
        try:
            agent.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.process.pid, signal.SIGKILL)
            agent.process.wait()


def run_emulated(options: EmulateOptions) -> int:
    """Build the network, run every host's tasks, tear down; the job's exit status
    (124 on timeout, 130 on Ctrl-C)."""
    check_privileges()
    one_per_rank = options.rank_order == "interleaved" and options.nproc_per_host > 1
    argv = command_argv(options.command, None if one_per_rank else options.nproc_per_host)
    stale = remove_stale()
    if stale:
        print(
            f"lamina emulate: removed {len(stale)} stale namespace(s) of a killed run", flush=True
        )
    network = EmulatedNetwork(options.hosts, options.link)
    agents: list[Agent] = []
    env = {k: v for k, v in os.environ.items() if k not in _OUTER and not k.startswith("PET_")}
    # the emulated hosts share this machine's cores: one intra-op thread per rank, as
    # torchrun gives several ranks of one host (spinning OpenMP threads of four ranks on
    # two cores slowed a 1 MiB reduce-scatter + all-gather inside a host 6x)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(
        f"lamina emulate: {options.hosts} host(s) x {options.nproc_per_host} rank(s), "
        f"link {options.link.describe()}, ranks {options.rank_order}",
        flush=True,
    )
    tasks = task_environments(options, os.getpid())
    injector = None
    if options.fault is not None:
        ranks = sorted(
            int(env["SLURM_PROCID"]) * (1 if one_per_rank else options.nproc_per_host) + local
            for h, env in tasks
            if h == options.fault.host
            for local in range(1 if one_per_rank else options.nproc_per_host)
        )
        injector = FaultInjector(options.fault, network, ranks)
    try:
        network.up()
        for host_index, slurm in tasks:
            host = network.hosts[host_index]
            label = (
                f"{host.hostname}/rank{slurm['SLURM_PROCID']}" if one_per_rank else host.hostname
            )
            process = subprocess.Popen(
                [*host.exec_prefix(), *argv],
                env={**env, **slurm},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            agent = Agent(host, label, process, injector=injector)
            agent.reader = threading.Thread(target=_read, args=(agent,), daemon=True)
            agent.reader.start()
            agents.append(agent)
        if injector is not None:
            injector.start()
        code = _wait(agents, options.timeout_s)
        if injector is not None and injector.fired_at is not None:
            after = time.monotonic() - injector.fired_at
            print(f"lamina emulate: the job ended {after:.1f} s after the fault", flush=True)
        return code
    except KeyboardInterrupt:
        print("lamina emulate: interrupted; stopping every host", file=sys.stderr, flush=True)
        return 130
    finally:
        _stop(agents)
        for agent in agents:
            if agent.reader is not None:
                agent.reader.join(timeout=5)
        network.down()


def _wait(agents: Sequence[Agent], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while True:
        codes = [a.process.poll() for a in agents]
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline:
            print(f"lamina emulate: still running after {timeout_s:g} s; stopping every host",
                  file=sys.stderr, flush=True)  # fmt: skip
            _report(agents)
            return 124
        if failed_at is not None and now - failed_at > GRACE_S:
            break
        time.sleep(0.2)
    _stop(agents)
    codes = [a.process.returncode for a in agents]  # all ended: _stop waited for them
    failed = [c for c in codes if c is not None and c != 0]
    if failed:
        _report(agents)
        return next((c for c in failed if c > 0), 1)
    return 0


def _report(agents: Sequence[Agent]) -> None:
    for agent in agents:
        code = agent.process.poll()
        if agent.reader is not None:
            agent.reader.join(timeout=2)
        state = "running" if code is None else f"exit {code}"
        print(f"--- {agent.label} ({state}), last {len(agent.tail)} lines ---", file=sys.stderr)
        for line in agent.tail:
            print(f"    {line}", file=sys.stderr)
    sys.stderr.flush()
