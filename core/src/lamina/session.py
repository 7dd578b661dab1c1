"""``lamina.init()``: from the torchrun environment to a ready runtime in one call."""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import HashStore, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from lamina.device.backend import Backend
from lamina.device.handle import DeviceHandle
from lamina.device.kernels import KernelLauncher
from lamina.device.mesh import (
    TOPOLOGY_AXES,
    DeviceMesh,
    axes_from_dict,
    grid_lines,
    planned_grid,
    tp_axis_warning,
)
from lamina.device.sharing import check_ranks_fit, collective_backend
from lamina.device.topology import HostTopology, Topology, merge_host_topologies
from lamina.device.topology_file import load_topology
from lamina.errors import ConfigError
from lamina.plugins import PluginRegistry, get_registry

#: Environment variable naming a declared topology file that replaces discovery.
TOPOLOGY_ENV = "LAMINA_TOPOLOGY"

#: ``"flat"``, ``"topology"``, ``(shape, axis_names)`` or ``{"dp": 1, "fsdp": 2, "tp": 2}``
#: (outermost axis first, at most four).
MeshSpec = Literal["flat", "topology"] | tuple[tuple[int, ...], tuple[str, ...]] | Mapping[str, int]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from the torchrun environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> LaunchEnv:
        """Read RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE; none set means one process."""
        env = dict(os.environ if environ is None else environ)
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return cls(0, 1, 0, 1)
        for required in ("RANK", "WORLD_SIZE"):
            if required not in env:
                other = "WORLD_SIZE" if required == "RANK" else "RANK"
                raise ConfigError(
                    f"{other} is set but {required} is not; launch with torchrun "
                    f"(or `lamina run`) or unset {other}"
                )
        rank = _env_int(env, "RANK", 0)
        world = _env_int(env, "WORLD_SIZE", 1)
        local_rank = _env_int(env, "LOCAL_RANK", 0)
        local_world = _env_int(env, "LOCAL_WORLD_SIZE", 1)
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(
                f"RANK={rank} is outside WORLD_SIZE={world}; RANK must be in 0..WORLD_SIZE-1"
            )
        if not 0 <= local_rank < max(local_world, 1):
            raise ConfigError(
                f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}; "
                "check the launcher's --nproc-per-node"
            )
        return cls(rank, world, local_rank, local_world)


def _env_int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to a whole number") from None


@dataclass
class Runtime:
    """The initialized job as this process sees it; returned by :func:`init`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: Backend
    handle: DeviceHandle
    device: torch.device
    topology: Topology
    mesh: DeviceMesh
    kernels: KernelLauncher
    plugins: PluginRegistry
    owns_process_group: bool
    #: Group for lamina's own CPU-object collectives (topology gather, pre-flight
    #: verification): a gloo group where the collective backend cannot carry CPU
    #: tensors, else the default group (``None``).
    control_group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    def shutdown(self) -> None:
        """Destroy the process group lamina created; safe to call twice."""
        shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


_RUNTIME: Runtime | None = None


def init(
    backend: str | None = None,
    *,
    topology: str | Path | Topology | None = None,
    mesh: MeshSpec = "flat",
    timeout: timedelta = timedelta(minutes=10),
) -> Runtime:
    """Join the job (torchrun environment, or a single process) and return the runtime.

    Picks the backend (``backend``, else ``$LAMINA_BACKEND``, else the best available),
    initializes torch.distributed with the backend's collective backend (reusing a
    process group the caller already created), sets this rank's device, builds the
    global topology (declared file from ``topology`` / ``$LAMINA_TOPOLOGY``, else
    discovered per rank and merged; ``"probe"``: discovered, then every host pair's link
    measured with send/recv, :mod:`lamina.device.probe`) and the device mesh:
    ``"flat"`` (one axis ``dp``), ``"topology"`` (``inter`` x ``intra`` from fast
    domains), ``(shape, axis_names)`` or a dict of up to four axes such as
    ``{"dp": 1, "fsdp": 2, "tp": 2}`` (outermost first); a ``"tp"`` axis whose groups
    leave a fast domain of the topology is warned about.
    Calling it again returns the same runtime.
    """
    global _RUNTIME
    if _RUNTIME is not None:
        if backend is not None and backend != _RUNTIME.backend.name:
            raise ConfigError(
                f"lamina is already initialized with backend {_RUNTIME.backend.name!r}; "
                f"call lamina.shutdown() before init(backend={backend!r})"
            )
        return _RUNTIME
    launch = LaunchEnv.from_environ()
    plugins = get_registry()
    chosen = plugins.select_backend(backend)
    chosen.prepare_process(
        launch.rank, launch.world_size, launch.local_rank, launch.local_world_size
    )
    handle = chosen.handle()
    if chosen.one_device_per_rank:  # before any process group: one line, no NCCL traceback
        check_ranks_fit(chosen, launch.local_world_size, handle.device_count())
    device = handle.device_for_local_rank(launch.local_rank)
    handle.set_device(device)
    from lamina.trace import user_collectives, watchdog
    from lamina.trace.recorder import get_recorder, start_from_env

    watchdog.timeout_from_env()  # a bad $LAMINA_COLLECTIVE_TIMEOUT fails before any group
    owns = _init_process_group(chosen, launch, timeout)
    try:
        control = _control_group(chosen, launch)
        topo = _build_topology(topology, chosen, plugins, launch, control)
        _agree_on_mesh(mesh, topo, launch, control)
        device_mesh = _build_mesh(mesh, chosen.device_type, topo)
        start_from_env(
            launch.rank,
            launch.world_size,
            chosen.name,
            str(dist.get_backend()) if dist.is_initialized() else "none",
        )
        active = get_recorder()
        if active is not None:  # dumps name each rank's host (a failed host is then named)
            active.hosts = {d.rank: d.host for d in topo.devices}
        user_collectives.install_from_env(get_recorder())
        watchdog.start_from_env(get_recorder())
    except BaseException:
        watchdog.stop_active()  # leave nothing half-built behind
        user_collectives.uninstall()
        from lamina.trace import recorder

        recorder.stop(write=False)
        if owns and dist.is_initialized():
            dist.destroy_process_group()
        raise
    _RUNTIME = Runtime(
        launch.rank,
        launch.world_size,
        launch.local_rank,
        launch.local_world_size,
        chosen,
        handle,
        device,
        topo,
        device_mesh,
        KernelLauncher(plugins.kernels, chosen.name),
        plugins,
        owns,
        control,
    )
    return _RUNTIME


def shutdown() -> None:
    """Tear down what :func:`init` created; a no-op when not initialized."""
    global _RUNTIME
    runtime, _RUNTIME = _RUNTIME, None
    if runtime is None:
        return
    from lamina.trace import recorder, user_collectives, watchdog

    watchdog.stop_active()  # before the store it polls goes away
    user_collectives.uninstall()
    recorder.stop(write=True)  # DIR/rank<r>.jsonl when $LAMINA_TRACE is set
    # Drop the mesh's process groups before destroying the default group: a gloo group
    # still referenced at interpreter exit can abort the process ("terminate called
    # without an active exception").
    runtime.mesh.release()
    runtime.control_group = None
    gc.collect()
    if runtime.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def current() -> Runtime | None:
    """The runtime :func:`init` returned, or None."""
    return _RUNTIME


#: torchrun's count of restarts of this worker group (0 on the first attempt).
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


#: The store this process's groups rendezvous through (``env://``), kept for the process's
#: life: the first group's (torch's ``env://`` store, or the one made under torchrun), so
#: that rank 0 keeps serving it on ``MASTER_PORT`` after ``shutdown()``.
_PROCESS_STORE: Store | None = None
#: How many process groups :func:`init` has created in this process.
_INITS = 0


def _rendezvous_store(backend: Backend, launch: LaunchEnv, timeout: timedelta) -> Store | None:
    """The store for this :func:`init`'s group, under a prefix of its own, or None where
    torch's own ``init_method`` is to make it (the first group outside torchrun, and other
    init methods than ``env://``, such as ``xla://``).

    torch's ``env://`` makes a store at each ``init_process_group``, rank 0 serving it on
    ``MASTER_PORT``, with no prefix. So ``init()`` after ``shutdown()`` raced: a rank that
    got there first reached rank 0's old server, not yet closed, read the first group's
    keys and went on while rank 0 waited in its new store (measured: 1 re-init in 3 failed
    or hung on 2 gloo ranks). Later groups therefore rendezvous on the first group's store
    (:func:`_keep_store`) under ``lamina/attempt-<a>/init-<n>/``. Under torchrun a store is
    made from the start: torchrun keeps its agent's store across restarts
    (``TORCHELASTIC_USE_AGENT_STORE``), where a restarted gloo group read the dead
    attempt's peer addresses (every ``--max-restarts`` restart failed in
    ``connectFullMesh`` with torch 2.13); the attempt in the prefix starts it clean."""
    global _PROCESS_STORE
    if backend.init_method != "env://":
        return None
    attempt = os.environ.get(RESTART_COUNT_ENV)
    if _PROCESS_STORE is None:
        if attempt is None:
            return None
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        _PROCESS_STORE = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            launch.world_size,
            is_master=not agent and launch.rank == 0,
            timeout=timeout,
            multi_tenant=not agent,
        )
    return PrefixStore(f"lamina/attempt-{attempt or 0}/init-{_INITS}/", _PROCESS_STORE)


def _keep_store(backend: Backend) -> None:
    """Count the group just made, and keep the first ``env://`` group's store (the one
    under torch's ``default_pg`` prefix) for the groups after it."""
    global _PROCESS_STORE, _INITS
    _INITS += 1
    if _PROCESS_STORE is None and backend.init_method == "env://":
        default = dist.distributed_c10d._get_default_store()
        _PROCESS_STORE = getattr(default, "underlying_store", None)


def _init_process_group(backend: Backend, launch: LaunchEnv, timeout: timedelta) -> bool:
    if dist.is_initialized():
        if dist.get_world_size() != launch.world_size:
            raise ConfigError(
                f"an existing process group has world size {dist.get_world_size()} but "
                f"WORLD_SIZE={launch.world_size}; destroy it or fix the environment"
            )
        return False
    if launch.world_size == 1 and "MASTER_ADDR" not in os.environ:
        store = HashStore()
        dist.init_process_group(
            collective_backend(backend), store=store, rank=0, world_size=1, timeout=timeout
        )
        return True
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ConfigError(
                f"{name} is not set for a {launch.world_size}-rank job; launch with torchrun "
                "(or `lamina run`), which sets it"
            )
    rendezvous = _rendezvous_store(backend, launch, timeout)
    dist.init_process_group(
        collective_backend(backend),
        init_method=None if rendezvous is not None else backend.init_method,
        store=rendezvous,
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timeout,
    )
    placed = (dist.get_rank(), dist.get_world_size())
    if placed != (launch.rank, launch.world_size):
        dist.destroy_process_group()
        raise ConfigError(
            f"the {backend.name} runtime placed this process at rank {placed[0]} of "
            f"{placed[1]} but RANK={launch.rank}, WORLD_SIZE={launch.world_size}; launch so "
            "that they agree (torchrun --node-rank must follow the runtime's host order)"
        )
    _keep_store(backend)
    return True


#: ``topology="probe"`` (or ``$LAMINA_TOPOLOGY=probe``): discover, then measure the links.
PROBE = "probe"


def _build_topology(
    declared: str | Path | Topology | None,
    backend: Backend,
    plugins: PluginRegistry,
    launch: LaunchEnv,
    control: dist.ProcessGroup | None,
) -> Topology:
    source = declared if declared is not None else os.environ.get(TOPOLOGY_ENV) or None
    if isinstance(source, Topology):
        topo = source
    elif source is not None and str(source) != PROBE:
        topo = load_topology(source)
    else:
        piece = _discover_host(backend, plugins, launch)
        if launch.world_size == 1:
            return merge_host_topologies([piece])
        pieces: list[HostTopology | None] = [None] * launch.world_size
        dist.all_gather_object(pieces, piece, group=control)
        merged = merge_host_topologies([p for p in pieces if p is not None])
        if source is None:
            return merged
        from lamina.device.probe import probe_topology

        return probe_topology(merged, launch.rank, group=control)
    if topo.world_size != launch.world_size:
        raise ConfigError(
            f"topology {source} declares {topo.world_size} ranks but WORLD_SIZE is "
            f"{launch.world_size}; use a topology file for this job size"
        )
    return topo


def _control_group(backend: Backend, launch: LaunchEnv) -> dist.ProcessGroup | None:
    """A ``control_backend`` group over all ranks, or None (use the default group)."""
    control = backend.control_backend
    if not control or launch.world_size == 1 or dist.get_backend() == "fake":
        return None  # a fake group (a planning process) has no peers to carry objects to
    group = dist.new_group(backend=control)
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"rank {launch.rank} is not a member of the {control} group")
    return group


def _discover_host(backend: Backend, plugins: PluginRegistry, launch: LaunchEnv) -> HostTopology:
    return plugins.discover_host(backend, launch.local_rank, launch.local_world_size)


def _mesh_axes(spec: MeshSpec) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """(shape or None for the topology's domains, axis names) of a mesh spec."""
    if spec == "flat":
        return None, ("dp",)
    if spec == "topology":
        return None, TOPOLOGY_AXES
    if isinstance(spec, Mapping):
        return axes_from_dict(spec)
    if isinstance(spec, tuple) and len(spec) == 2:
        return tuple(spec[0]), tuple(spec[1])
    raise ConfigError(
        f"mesh={spec!r} is not understood; use 'flat', 'topology', (shape, axis_names) "
        "or a dict such as {'dp': 2, 'tp': 2}"
    )


def _agree_on_mesh(
    spec: MeshSpec, topology: Topology, launch: LaunchEnv, control: dist.ProcessGroup | None
) -> None:
    """Before any mesh group exists, every rank checks that all build the same mesh: a rank
    that builds another one would otherwise hang the others in the mesh's group creation.
    A difference raises the pre-flight error naming the rank on every rank."""
    shape, names = _mesh_axes(spec)
    if spec == "flat":
        shape = (topology.world_size,)
    grid = planned_grid(shape, names, topology)
    if launch.world_size == 1:
        return
    from lamina.verify import Manifest, preflight

    preflight(Manifest(launch.rank, (("mesh", grid_lines(grid, names)),)), group=control)


def _build_mesh(spec: MeshSpec, device_type: str, topology: Topology) -> DeviceMesh:
    shape, names = _mesh_axes(spec)
    if shape is None and spec == "topology":
        return DeviceMesh.from_topology(device_type, topology)
    mesh = DeviceMesh.from_shape(device_type, shape or (topology.world_size,), names, topology)
    warning = tp_axis_warning(mesh.ranks(), mesh.axis_names, topology)
    if warning is not None:
        warnings.warn(warning, UserWarning, stacklevel=3)
    return mesh
