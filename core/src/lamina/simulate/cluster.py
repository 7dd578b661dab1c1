"""The declared cluster ``lamina plan --simulate`` predicts for: its file format and loader.

A cluster file is a JSON object that declares a cluster by its *classes* of links, not
by its devices (no pairwise link list: 4096 devices would need 8 million links)::

    {
      "name": "512 x 8 H100",
      "hosts": 512,
      "devices_per_host": 8,
      "device_memory_gib": 80,
      "intra": {"kind": "nvlink", "bandwidth_gbps": 450, "latency_us": 3},
      "inter": {"kind": "ib", "bandwidth_gbit": 400, "latency_us": 5, "nics_per_host": 8}
    }

- ``hosts``, ``devices_per_host``: positive integers, at most :data:`MAX_DEVICES` in all.
  Ranks are placed host by host, as torchrun places them (host ``h`` holds ranks
  ``h*L .. h*L+L-1``).
- ``intra``: the link between two devices of one host; ``inter``: one NIC of a host.
  A bandwidth is given once, per direction, either as ``bandwidth_gbps`` in GB/s
  (gigabytes per second: the unit of lamina's topology files) or as ``bandwidth_gbit``
  in Gb/s (gigabits per second: how NICs are sold; 400 Gb/s = 50 GB/s).
  ``latency_us`` is the one-message latency in microseconds; ``kind`` is free text.
- ``inter.nics_per_host`` (default 1): a host's uplink is ``nics_per_host`` times one
  NIC's bandwidth; flows leaving a host share the uplink (see
  :mod:`lamina.comm.cost`).
- ``intra`` may be left out when ``devices_per_host`` is 1, ``inter`` when ``hosts``
  is 1; ``name`` and ``device_memory_gib`` are optional.
- ``mesh`` (optional): the simulated job's mesh, axis name -> size, outermost first as
  ``lamina.init(mesh=...)`` takes it (the last axis innermost: consecutive ranks), e.g.
  ``{"fsdp": 512, "tp": 8}``; the sizes multiply to the device count, and each axis with
  the axes inside it spans a divisor or a multiple of ``devices_per_host`` ranks. A plan's
  collectives on those axes (``tp``, ``fsdp``, ``dp+fsdp``, ...) run on the mesh's groups
  (:meth:`Cluster.mesh_group`), whatever group sizes the capture had.

Every problem raises :class:`~lamina.errors.ConfigError` with one line naming the file,
the field and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from lamina.comm.cost import CostModel, LinkCost
from lamina.comm.layout import HostLayout
from lamina.errors import ConfigError
from lamina.units import format_bytes

#: The most devices a cluster file may declare.
MAX_DEVICES = 4096
#: Gb/s per GB/s.
BITS_PER_BYTE = 8

_TOP_KEYS = (
    "name",
    "hosts",
    "devices_per_host",
    "device_memory_gib",
    "intra",
    "inter",
    "mesh",
)
#: Most axes a simulated mesh may have (as :data:`lamina.device.mesh.MAX_MESH_AXES`).
MAX_MESH_AXES = 4
#: Axis names a plan gives groups that are not mesh axes: the whole job.
WORLD_AXIS = "world"
_LINK_KEYS = ("kind", "bandwidth_gbps", "bandwidth_gbit", "latency_us")
_INTER_KEYS = (*_LINK_KEYS, "nics_per_host")
_EXAMPLE = (
    '{"hosts": 512, "devices_per_host": 8, "intra": {"kind": "nvlink", "bandwidth_gbps": '
    '450, "latency_us": 3}, "inter": {"bandwidth_gbit": 400, "latency_us": 5, '
    '"nics_per_host": 8}}'
)


@dataclass(frozen=True)
class ClusterCostModel(CostModel):
    """A :class:`~lamina.comm.cost.CostModel` whose rings cost O(1) after a first look.

    The base model walks every edge of a ring for every prediction (O(P)). On a declared
    cluster every intra edge costs the same and every inter edge the same, so a ring's
    step is the larger of the two classes it uses: this model finds, once per ring order,
    which classes it uses and how many edges leave a host, then gives the same figures
    as the base model (the same expressions) at any size.
    """

    _rings: dict[tuple[int, ...], tuple[bool, bool, int]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def ring_shape(self, order: tuple[int, ...]) -> tuple[bool, bool, int]:
        """(has intra edges, has inter edges, most edges leaving one host) of a ring."""
        if order not in self._rings:
            hosts = [self.layout.host_of(r) for r in order]
            same = [hosts[k] == hosts[(k + 1) % len(hosts)] for k in range(len(hosts))]
            self._rings[order] = (any(same), not all(same), self.layout.crossings(order))
        return self._rings[order]

    def ring_all_reduce(self, order: tuple[int, ...], nbytes: float) -> float:
        """A ring all-reduce over ``order``: ``2(P-1)`` steps, each its slowest edge."""
        p = len(order)
        if p < 2:
            return 0.0
        has_intra, has_inter, share = self.ring_shape(order)
        chunk = nbytes / p
        step = 0.0
        if has_intra:
            step = max(step, self.intra.time(chunk))
        if has_inter:
            step = max(step, self.inter.time(chunk, share))
        return 2 * (p - 1) * step


@dataclass(frozen=True)
class ClusterLink:
    """One class of link: bandwidth per direction in GB/s, latency in microseconds."""

    kind: str
    bandwidth_gbps: float
    latency_us: float

    def cost(self, flows_per_link: int = 1, links: int = 1) -> LinkCost:
        """The alpha-beta cost of ``links`` such links bonded together (a host's NICs),
        shared by ``flows_per_link`` flows that always run at once."""
        return LinkCost(
            self.latency_us * 1e-6, flows_per_link / (links * self.bandwidth_gbps * 1e9)
        )

    def describe(self) -> str:
        """``nvlink 450 GB/s, 3.0 us``."""
        return f"{self.kind} {self.bandwidth_gbps:g} GB/s, {self.latency_us:g} us"


@dataclass(frozen=True)
class Cluster:
    """A declared cluster of ``hosts`` x ``devices_per_host`` devices."""

    hosts: int
    devices_per_host: int
    intra: ClusterLink
    #: One NIC of a host.
    inter: ClusterLink
    nics_per_host: int = 1
    device_memory_gib: float | None = None
    name: str = ""
    source: str = "cluster"
    #: The simulated mesh: (axis, size) outermost first; empty when not declared.
    mesh: tuple[tuple[str, int], ...] = ()

    @property
    def world_size(self) -> int:
        """Devices (ranks) in the cluster."""
        return self.hosts * self.devices_per_host

    @property
    def uplink_gbps(self) -> float:
        """GB/s one host can send to the others at once (all its NICs)."""
        return self.nics_per_host * self.inter.bandwidth_gbps

    @property
    def device_memory_bytes(self) -> int | None:
        """Memory of one device in bytes (``None``: not declared)."""
        if self.device_memory_gib is None:
            return None
        return int(self.device_memory_gib * 2**30)

    def layout(self, hosts: int | None = None, per_host: int | None = None) -> HostLayout:
        """``hosts`` x ``per_host`` ranks placed host by host (default: the whole cluster)."""
        h = self.hosts if hosts is None else hosts
        local = self.devices_per_host if per_host is None else per_host
        names = tuple(f"host{i}" for i in range(h))
        return HostLayout(names, tuple(tuple(range(i * local, (i + 1) * local)) for i in range(h)))

    def cost_model(self) -> ClusterCostModel:
        """The cost model of the whole cluster as one group: intra from ``intra``, inter
        from a host's uplink (every NIC), which the model shares among the flows that
        leave the host at once."""
        return ClusterCostModel(
            self.layout(), self.intra.cost(), self.inter.cost(links=self.nics_per_host), "declared"
        )

    def host_model(self) -> ClusterCostModel:
        """The cost model of one host's ranks (a group on the ``intra`` axis)."""
        return ClusterCostModel(
            self.layout(1), self.intra.cost(), self.inter.cost(links=self.nics_per_host), "declared"
        )

    def rail_model(self) -> ClusterCostModel:
        """The cost model of one rank per host (a group on the ``inter`` axis): every
        host's ``devices_per_host`` such groups run at once, so each of their flows gets
        ``1 / devices_per_host`` of the uplink."""
        inter = self.inter.cost(self.devices_per_host, self.nics_per_host)
        return ClusterCostModel(self.layout(per_host=1), self.intra.cost(), inter, "declared")

    def mesh_group(self, axes: tuple[str, ...]) -> tuple[int, int]:
        """(hosts, ranks per host) of a group over mesh ``axes`` (rank 0's; every group of
        those axes has the same shape, as the mesh was checked against the hosts)."""
        sizes = dict(self.mesh)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            _fail(
                self.source,
                "mesh",
                f"has no axis {unknown[0]!r} (axes {list(sizes)}); add it to the mesh",
            )
        ranks, stride = [0], 1
        for name, size in reversed(self.mesh):
            if name in axes:
                ranks = [r + k * stride for k in range(size) for r in ranks]
            stride *= size
        per_host: dict[int, int] = {}
        for rank in ranks:
            host = rank // self.devices_per_host
            per_host[host] = per_host.get(host, 0) + 1
        return len(per_host), max(per_host.values())

    def group_model(self, hosts: int, per_host: int) -> ClusterCostModel:
        """The cost model of a group of ``per_host`` ranks on each of ``hosts`` hosts, one
        of the ``devices_per_host / per_host`` such groups of each host that run at once
        (their flows share the host's uplink)."""
        flows = max(1, self.devices_per_host // per_host) if hosts > 1 else 1
        inter = self.inter.cost(flows, self.nics_per_host)
        layout = self.layout(hosts, per_host)
        return ClusterCostModel(layout, self.intra.cost(), inter, "declared")

    def describe_mesh(self) -> str:
        """``fsdp=512 x tp=8`` (empty: no mesh declared)."""
        return " x ".join(f"{name}={size}" for name, size in self.mesh)

    def describe(self) -> str:
        """One line: size, links, device memory, mesh."""
        name = f"{self.name}: " if self.name else ""
        nic = self.inter
        inter = (
            f"inter {self.nics_per_host} x {nic.kind} NIC {nic.bandwidth_gbps:g} GB/s "
            f"({nic.bandwidth_gbps * BITS_PER_BYTE:g} Gb/s) = {self.uplink_gbps:g} GB/s uplink "
            f"per host, {nic.latency_us:g} us"
        )
        memory = self.device_memory_bytes
        mem = f"; {format_bytes(memory)} per device" if memory is not None else ""
        mesh = f"; mesh {self.describe_mesh()}" if self.mesh else ""
        return (
            f"{name}{self.hosts} host(s) x {self.devices_per_host} device(s) = "
            f"{self.world_size} devices; intra {self.intra.describe()}; {inter}{mem}{mesh}"
        )

    def to_json(self) -> dict[str, Any]:
        """The cluster as the file format writes it (bandwidths in GB/s)."""
        return {
            "name": self.name,
            "hosts": self.hosts,
            "devices_per_host": self.devices_per_host,
            "device_memory_gib": self.device_memory_gib,
            "intra": {
                "kind": self.intra.kind,
                "bandwidth_gbps": self.intra.bandwidth_gbps,
                "latency_us": self.intra.latency_us,
            },
            "inter": {
                "kind": self.inter.kind,
                "bandwidth_gbps": self.inter.bandwidth_gbps,
                "latency_us": self.inter.latency_us,
                "nics_per_host": self.nics_per_host,
            },
            "mesh": dict(self.mesh),
            "world_size": self.world_size,
            "uplink_gbps": self.uplink_gbps,
        }


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate the cluster file at ``path`` (see the module docstring)."""
    source = str(path)
    file = Path(path)
    if not file.is_file():
        _fail(source, "", f"no such file; pass a cluster JSON file such as {_EXAMPLE}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        _fail(source, "", f"not valid JSON ({exc}); fix the syntax")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(source, "", f"cannot be read ({exc}); pass a readable UTF-8 JSON file")
    return cluster_from_dict(data, source)


def cluster_from_dict(data: Any, source: str = "cluster") -> Cluster:
    """Validate a parsed cluster file; ``source`` names it in the errors."""
    if not isinstance(data, dict):
        _fail(source, "", f"must hold a JSON object, got {_kind(data)}; write {_EXAMPLE}")
    _unknown(source, "", data, _TOP_KEYS)
    hosts = _positive_int(source, "hosts", data, "give the number of hosts, e.g. 512")
    local = _positive_int(
        source, "devices_per_host", data, "give the devices (ranks) per host, e.g. 8"
    )
    if hosts * local > MAX_DEVICES:
        _fail(
            source,
            "",
            f'"hosts" x "devices_per_host" = {hosts} x {local} = {hosts * local} devices, over '
            f"the limit of {MAX_DEVICES} that lamina plan --simulate models; declare fewer "
            "hosts or devices per host",
        )
    name = data.get("name", "")
    if not isinstance(name, str):
        _fail(source, "name", f"must be a string, got {_show(name)}; name the cluster or drop it")
    memory = data.get("device_memory_gib")
    if memory is not None:
        memory = _positive_number(source, "device_memory_gib", memory, "the device memory in GiB")
    intra = _link(source, "intra", data, required=local > 1, default_kind="intra-host")
    inter_data = data.get("inter")
    inter = _link(source, "inter", data, required=hosts > 1, default_kind="network")
    nics = 1
    if isinstance(inter_data, dict) and "nics_per_host" in inter_data:
        nics = _positive_int(
            source, "inter.nics_per_host", inter_data, "give the NICs of one host, e.g. 8"
        )
    if intra is None:  # one device per host: no intra link is ever used
        intra = inter or ClusterLink("intra-host", 1.0, 0.0)
    if inter is None:  # one host: no inter link is ever used
        inter = ClusterLink("network", intra.bandwidth_gbps, intra.latency_us)
    cluster = Cluster(hosts, local, intra, inter, nics, memory, name, source)
    if "mesh" in data:
        cluster = with_mesh(cluster, data["mesh"], source, "mesh")
    return cluster


def with_mesh(cluster: Cluster, mesh: Any, source: str, field: str = "mesh") -> Cluster:
    """``cluster`` with the simulated ``mesh`` (axis -> size, outermost first), checked
    against its hosts; ``source`` and ``field`` name it in the errors."""
    example = _mesh_example(cluster)
    if not isinstance(mesh, dict) or not mesh:
        got = "no axes" if isinstance(mesh, dict) else _show(mesh)
        _fail(
            source,
            field,
            f"must map axis names to sizes, outermost first, got {got}; write e.g. {example}",
        )
    if len(mesh) > MAX_MESH_AXES:
        _fail(
            source,
            field,
            f"has {len(mesh)} axes {list(mesh)}, at most {MAX_MESH_AXES}; merge some axes",
        )
    axes: list[tuple[str, int]] = []
    for name in mesh:
        where = f"{field}.{name}"
        if not name or "+" in name or name == WORLD_AXIS:
            _fail(
                source,
                where,
                f"is not an axis name; name an axis as the plan does (e.g. tp, fsdp, dp), "
                f"not {WORLD_AXIS!r}, empty or joined with '+'",
            )
        size = mesh[name]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            _fail(
                source,
                where,
                f"must be a positive integer, got {_show(size)}; give the axis's ranks, e.g. 8",
            )
        axes.append((name, size))
    total = math.prod(s for _, s in axes)
    if total != cluster.world_size:
        shown = " x ".join(f"{n} {s}" for n, s in axes)
        _fail(
            source,
            field,
            f"= {shown} = {total} ranks, but the cluster has {cluster.hosts} x "
            f"{cluster.devices_per_host} = {cluster.world_size} devices; make the sizes "
            f"multiply to {cluster.world_size}, e.g. {example}",
        )
    local, inner = cluster.devices_per_host, 1
    for name, size in reversed(axes):
        inner *= size
        if local % inner and inner % local:
            _fail(
                source,
                f"{field}.{name}",
                f"and the axes inside it span {inner} consecutive ranks, which splits hosts "
                f"of {local} devices unevenly; choose sizes whose inner products divide or "
                f"are multiples of devices_per_host ({local})",
            )
    return replace(cluster, mesh=tuple(axes))


def parse_mesh_option(text: str) -> dict[str, int]:
    """``{"fsdp": 512, "tp": 8}`` from ``--mesh fsdp=512,tp=8`` (outermost first)."""
    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name.strip() or not size.strip().isdigit():
            raise ConfigError(
                f"--mesh {text!r}: {part.strip()!r} is not AXIS=SIZE; write the axes "
                "outermost first, e.g. --mesh fsdp=512,tp=8"
            )
        if name.strip() in mesh:
            raise ConfigError(
                f"--mesh {text!r}: axis {name.strip()!r} is given twice; name each axis once"
            )
        mesh[name.strip()] = int(size)
    return mesh


def _mesh_example(cluster: Cluster) -> str:
    local, world = cluster.devices_per_host, cluster.world_size
    if world == local:
        return f'"mesh": {{"tp": {local}}} (--mesh tp={local})'
    outer = world // local
    return f'"mesh": {{"fsdp": {outer}, "tp": {local}}} (--mesh fsdp={outer},tp={local})'


def _link(
    source: str, field: str, data: dict[str, Any], *, required: bool, default_kind: str
) -> ClusterLink | None:
    if field not in data:
        if required:
            why = "hosts > 1" if field == "inter" else "devices_per_host > 1"
            _fail(
                source,
                field,
                f"is missing ({why}); declare the link, e.g. "
                + (
                    '"inter": {"bandwidth_gbit": 400, "latency_us": 5, "nics_per_host": 8}'
                    if field == "inter"
                    else '"intra": {"kind": "nvlink", "bandwidth_gbps": 450, "latency_us": 3}'
                ),
            )
        return None
    link = data[field]
    if not isinstance(link, dict):
        _fail(
            source,
            field,
            f"must be an object, got {_show(link)}; declare it as "
            '{"bandwidth_gbps": 450, "latency_us": 3} (or bandwidth_gbit in Gb/s)',
        )
    _unknown(source, field, link, _INTER_KEYS if field == "inter" else _LINK_KEYS)
    kind = link.get("kind", default_kind)
    if not isinstance(kind, str) or not kind:
        _fail(
            source,
            f"{field}.kind",
            f"must be a non-empty string, got {_show(kind)}; name the link kind (e.g. "
            '"nvlink") or leave it out',
        )
    has_bytes, has_bits = "bandwidth_gbps" in link, "bandwidth_gbit" in link
    if has_bytes == has_bits:
        what = "both are given; keep one" if has_bytes else "it is missing; add one"
        _fail(
            source,
            f"{field}.bandwidth_gbps",
            f"needs exactly one of bandwidth_gbps (GB/s) or bandwidth_gbit (Gb/s): {what}",
        )
    key = "bandwidth_gbps" if has_bytes else "bandwidth_gbit"
    value = _positive_number(
        source, f"{field}.{key}", link[key], "the bandwidth per direction (> 0)"
    )
    bandwidth = value if has_bytes else value / BITS_PER_BYTE
    if "latency_us" not in link:
        _fail(source, f"{field}.latency_us", "is missing; give the link latency in microseconds")
    latency = link["latency_us"]
    if not _is_number(latency) or latency < 0 or not math.isfinite(latency):
        _fail(
            source,
            f"{field}.latency_us",
            f"must be a number >= 0, got {_show(latency)}; give the latency in microseconds",
        )
    return ClusterLink(kind, float(bandwidth), float(latency))


def _positive_int(source: str, field: str, data: dict[str, Any], fix: str) -> int:
    key = field.rsplit(".", 1)[-1]
    if key not in data:
        _fail(source, field, f"is missing; {fix}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(source, field, f"must be a positive integer, got {_show(value)}; {fix}")
    return int(value)


def _positive_number(source: str, field: str, value: Any, what: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        _fail(source, field, f"must be a number > 0, got {_show(value)}; give {what}")
    return float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _unknown(source: str, where: str, data: dict[str, Any], known: tuple[str, ...]) -> None:
    for key in data:
        if key not in known:
            field = f"{where}.{key}" if where else str(key)
            _fail(source, field, f"is not a known field; use only {list(known)}")


def _show(value: Any) -> str:
    return json.dumps(value) if _jsonable(value) else repr(value)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _fail(source: str, field: str, message: str) -> NoReturn:
    where = f'"{field}" ' if field else ""
    raise ConfigError(f"{source}: {where}{message}")
