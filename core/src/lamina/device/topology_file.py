"""Read and write a :class:`~lamina.device.topology.Topology` as JSON (format version 1).

Every problem in a file raises :class:`~lamina.errors.TopologyError` with one line of the
form ``"{source}: {field path}: {what is wrong}; {how to fix}"``, for example::

    topo.json: links[2].bandwidth_gbps: must be > 0, got -5.0; give the link's bandwidth ...

Links are written normalized (``a < b``); lists keep the order of the topology, keys are
sorted, so the same topology always gives the same file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from typing import Any, NoReturn, cast

from lamina.device.topology import (
    DEFAULT_NETWORK_LINK,
    LINK_KINDS,
    LINK_SOURCES,
    DeviceInfo,
    FastDomain,
    Link,
    LinkProfile,
    LinkSource,
    Topology,
)
from lamina.errors import TopologyError

__all__ = ["load_topology", "save_topology", "topology_from_dict", "topology_to_dict"]

#: The file format version this module reads and writes.
FORMAT_VERSION = 1

_TOP_KEYS = ("version", "devices", "links", "fast_domains", "default_link")
_DEVICE_KEYS = ("rank", "local_rank", "host", "device_type", "device_index", "numa_node")
_LINK_KEYS = ("a", "b", "bandwidth_gbps", "latency_us", "kind", "source")
_PROFILE_KEYS = ("bandwidth_gbps", "latency_us", "kind", "source")
_DOMAIN_KEYS = ("name", "ranks")
_TOP = "(top level)"


# --------------------------------------------------------------------------- writing


def _profile_to_dict(profile: LinkProfile) -> dict[str, Any]:
    return {
        "bandwidth_gbps": profile.bandwidth_gbps,
        "latency_us": profile.latency_us,
        "kind": profile.kind,
        "source": profile.source,
    }


def topology_to_dict(topo: Topology) -> dict[str, Any]:
    """The JSON-ready dict (format version 1) describing ``topo``."""
    devices = [
        {
            "rank": d.rank,
            "local_rank": d.local_rank,
            "host": d.host,
            "device_type": d.device_type,
            "device_index": d.device_index,
            "numa_node": d.numa_node,
        }
        for d in topo.devices
    ]
    links = [
        {"a": min(link.a, link.b), "b": max(link.a, link.b), **_profile_to_dict(link.profile)}
        for link in topo.links
    ]
    domains = [{"name": dom.name, "ranks": list(dom.ranks)} for dom in topo.fast_domains]
    return {
        "version": FORMAT_VERSION,
        "devices": devices,
        "links": links,
        "fast_domains": domains,
        "default_link": _profile_to_dict(topo.default_link),
    }


def save_topology(topo: Topology, path: str | os.PathLike[str]) -> None:
    """Write ``topo`` to ``path`` as pretty, key-sorted JSON, atomically.

    The data is validated first (a file this function writes always loads back); the
    text goes to a temporary file in the same directory, which then replaces ``path``.
    """
    target = os.fspath(path)
    data = topology_to_dict(topo)
    topology_from_dict(data, source=target)
    text = json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- reading


class _Object(dict[str, Any]):
    """A JSON object that remembers keys given more than once."""

    duplicates: tuple[str, ...] = ()


def _object_hook(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    dupes: list[str] = []
    for key, value in pairs:
        if key in obj and key not in dupes:
            dupes.append(key)
        obj[key] = value
    obj.duplicates = tuple(dupes)
    return obj


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Read and validate the topology file at ``path``; errors name the file."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise TopologyError(
            f"{source}: (file): cannot read: {reason}; check the path and its permissions"
        ) from exc
    except UnicodeDecodeError as exc:
        raise TopologyError(
            f"{source}: (file): not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "save the file as UTF-8 JSON"
        ) from exc
    try:
        data = json.loads(text, object_pairs_hook=_object_hook)
    except json.JSONDecodeError as exc:
        raise TopologyError(
            f"{source}: line {exc.lineno} column {exc.colno}: invalid JSON ({exc.msg}); "
            "fix the JSON syntax there"
        ) from exc
    return topology_from_dict(data, source=source)


def topology_from_dict(data: object, source: str = "<dict>") -> Topology:
    """Validate ``data`` (a parsed topology file) and build the :class:`Topology`.

    ``source`` names the data in error messages (the file path when loading a file).
    """
    return _Reader(source).topology(data)


def _describe(value: object) -> str:
    """``value``'s JSON type, with the value itself for scalars (shortened)."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    kind = {bool: "boolean", str: "string", int: "number", float: "number"}.get(type(value))
    text = _show(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{kind} {text}" if kind else text


def _show(value: object) -> str:
    return json.dumps(value) if isinstance(value, (str, bool)) or value is None else repr(value)


def _join(path: str, key: str) -> str:
    return key if path == _TOP else f"{path}.{key}"


class _Reader:
    """Validates one parsed document; every failure names ``source`` and the field path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, what: str, fix: str) -> NoReturn:
        message = f"{self.source}: {path}: {what}; {fix}"
        raise TopologyError(" ".join(message.split()))

    # ----------------------------------------------------------------- building blocks

    def obj(
        self, value: object, path: str, allowed: tuple[str, ...], required: tuple[str, ...]
    ) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"must be a JSON object, got {_describe(value)}", "write {...}")
        for key in getattr(value, "duplicates", ()):
            self.fail(_join(path, key), "key given more than once", "keep only one of them")
        listed = ", ".join(allowed)
        for key in value:
            if key not in allowed:
                self.fail(_join(path, key), "unknown key", f"allowed keys here are {listed}")
        for key in required:
            if key not in value:
                needed = ", ".join(required)
                self.fail(
                    _join(path, key), "missing required field", f"add it (required: {needed})"
                )
        return value

    def array(self, value: object, path: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(path, f"must be a JSON array, got {_describe(value)}", "write [...]")
        return value

    def integer(self, value: object, path: str, fix: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer, got {_describe(value)}", fix)
        if value < 0:
            self.fail(path, f"must be >= 0, got {value}", fix)
        return value

    def number(self, value: object, path: str, fix: str, positive: bool) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"must be a number, got {_describe(value)}", fix)
        number = float(value)
        if not math.isfinite(number):
            self.fail(path, f"must be a finite number, got {number}", fix)
        if positive and number <= 0:
            self.fail(path, f"must be > 0, got {number}", fix)
        if not positive and number < 0:
            self.fail(path, f"must be >= 0, got {number}", fix)
        return number

    def string(self, value: object, path: str, fix: str) -> str:
        if not isinstance(value, str):
            self.fail(path, f"must be a string, got {_describe(value)}", fix)
        if not value.strip():
            self.fail(path, "must not be empty", fix)
        return value

    def choice(self, value: object, path: str, choices: frozenset[str], what: str) -> str:
        options = ", ".join(sorted(choices))
        text = self.string(value, path, f"use one of {options}")
        if text not in choices:
            self.fail(path, f"unknown {what} {_show(text)}", f"use one of {options}")
        return text

    # ----------------------------------------------------------------- sections

    def topology(self, data: object) -> Topology:
        top = _TOP
        if not isinstance(data, dict):
            self.fail(
                top, f"must be a JSON object, got {_describe(data)}", 'write {"version": 1, ...}'
            )
        if "version" not in data:
            self.fail("version", "missing required field", f'add "version": {FORMAT_VERSION}')
        version = data["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version != FORMAT_VERSION:
            self.fail(
                "version",
                f"unsupported version {_show(version)}",
                f"this lamina reads version {FORMAT_VERSION}",
            )
        doc = self.obj(data, top, _TOP_KEYS, ("version", "devices"))
        devices = self.devices(doc["devices"])
        world = len(devices)
        links = self.links(doc.get("links", []), world)
        domains = self.domains(doc.get("fast_domains", []), world)
        default = DEFAULT_NETWORK_LINK
        if "default_link" in doc:
            default = self.profile(doc["default_link"], "default_link", _PROFILE_KEYS)
        return Topology(tuple(devices), tuple(links), tuple(domains), default)

    def devices(self, value: object) -> list[DeviceInfo]:
        items = self.array(value, "devices")
        if not items:
            self.fail("devices", "must not be empty", "list one device per rank")
        world = len(items)
        ranks_fix = f"give each device a distinct rank in 0..{world - 1}"
        seen_rank: dict[int, int] = {}
        seen_slot: dict[tuple[str, int], int] = {}
        out: list[DeviceInfo] = []
        for i, item in enumerate(items):
            path = f"devices[{i}]"
            d = self.obj(item, path, _DEVICE_KEYS, _DEVICE_KEYS[:5])
            rank = self.integer(d["rank"], f"{path}.rank", ranks_fix)
            if rank >= world:
                self.fail(f"{path}.rank", f"rank {rank} out of range 0..{world - 1}", ranks_fix)
            if rank in seen_rank:
                self.fail(
                    f"{path}.rank",
                    f"duplicate rank {rank} (also devices[{seen_rank[rank]}])",
                    ranks_fix,
                )
            seen_rank[rank] = i
            local_rank = self.integer(
                d["local_rank"], f"{path}.local_rank", "give the rank's index on its host (>= 0)"
            )
            host = self.string(d["host"], f"{path}.host", "give the host name")
            slot = (host, local_rank)
            if slot in seen_slot:
                self.fail(
                    f"{path}.local_rank",
                    f"duplicate local_rank {local_rank} on host {_show(host)} "
                    f"(also devices[{seen_slot[slot]}])",
                    "give each rank on a host a distinct local_rank",
                )
            seen_slot[slot] = i
            device_type = self.string(
                d["device_type"], f"{path}.device_type", 'give the device type, e.g. "cuda"'
            )
            index = self.integer(
                d["device_index"], f"{path}.device_index", "give the device's index (>= 0)"
            )
            numa = d.get("numa_node")
            if numa is not None:
                numa = self.integer(
                    numa, f"{path}.numa_node", "give the NUMA node id (>= 0) or null"
                )
            out.append(DeviceInfo(rank, local_rank, host, device_type, index, numa))
        return out

    def profile(self, value: object, path: str, allowed: tuple[str, ...]) -> LinkProfile:
        p = self.obj(value, path, allowed, ("bandwidth_gbps", "latency_us", "kind"))
        bandwidth = self.number(
            p["bandwidth_gbps"],
            f"{path}.bandwidth_gbps",
            "give the link's bandwidth in GB/s per direction",
            positive=True,
        )
        latency = self.number(
            p["latency_us"],
            f"{path}.latency_us",
            "give the link's latency in microseconds (>= 0)",
            positive=False,
        )
        kind = self.choice(p["kind"], f"{path}.kind", LINK_KINDS, "link kind")
        source: LinkSource = "declared"
        if "source" in p:
            source = cast(
                LinkSource, self.choice(p["source"], f"{path}.source", LINK_SOURCES, "source")
            )
        return LinkProfile(bandwidth, latency, kind, source)

    def links(self, value: object, world: int) -> list[Link]:
        items = self.array(value, "links")
        rank_fix = f"link two existing ranks (0..{world - 1})"
        seen: dict[tuple[int, int], int] = {}
        out: list[Link] = []
        for i, item in enumerate(items):
            path = f"links[{i}]"
            d = self.obj(item, path, _LINK_KEYS, ("a", "b", "bandwidth_gbps", "latency_us", "kind"))
            ends = []
            for end in ("a", "b"):
                rank = self.integer(d[end], f"{path}.{end}", rank_fix)
                if rank >= world:
                    self.fail(f"{path}.{end}", f"rank {rank} does not exist", rank_fix)
                ends.append(rank)
            a, b = ends
            if a == b:
                self.fail(f"{path}.b", f"same rank as a ({a})", "a link joins two different ranks")
            pair = (min(a, b), max(a, b))
            if pair in seen:
                self.fail(
                    path,
                    f"duplicate link between ranks {pair[0]} and {pair[1]} "
                    f"(also links[{seen[pair]}])",
                    "give each pair of ranks at most one link",
                )
            seen[pair] = i
            profile = self.profile(
                {k: v for k, v in d.items() if k not in ("a", "b")}, path, _PROFILE_KEYS
            )
            out.append(Link(pair[0], pair[1], profile))
        return out

    def domains(self, value: object, world: int) -> list[FastDomain]:
        items = self.array(value, "fast_domains")
        rank_fix = f"list existing ranks (0..{world - 1}), each in at most one domain"
        names: dict[str, int] = {}
        owner: dict[int, int] = {}
        out: list[FastDomain] = []
        for i, item in enumerate(items):
            path = f"fast_domains[{i}]"
            d = self.obj(item, path, _DOMAIN_KEYS, _DOMAIN_KEYS)
            name = self.string(d["name"], f"{path}.name", "give the domain a name")
            if name in names:
                self.fail(
                    f"{path}.name",
                    f"duplicate domain name {_show(name)} (also fast_domains[{names[name]}])",
                    "give each fast domain a distinct name",
                )
            names[name] = i
            ranks = self.array(d["ranks"], f"{path}.ranks")
            if not ranks:
                self.fail(f"{path}.ranks", "must not be empty", "list the domain's ranks")
            members: list[int] = []
            for j, r in enumerate(ranks):
                rpath = f"{path}.ranks[{j}]"
                rank = self.integer(r, rpath, rank_fix)
                if rank >= world:
                    self.fail(rpath, f"rank {rank} does not exist", rank_fix)
                if rank in owner:
                    where = "this domain" if owner[rank] == i else f"fast_domains[{owner[rank]}]"
                    self.fail(rpath, f"rank {rank} is already in {where}", rank_fix)
                owner[rank] = i
                members.append(rank)
            out.append(FastDomain(name, tuple(members)))
        return out
