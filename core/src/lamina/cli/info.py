"""``lamina info``: what is installed, what can run here, and why not."""

from __future__ import annotations

import platform
from typing import Any

from rich.console import Console
from rich.table import Table

from lamina.device.backend import Backend
from lamina.errors import LaminaError
from lamina.plugins import PluginRegistry
from lamina.versions import package_version

#: Distributions whose versions ``lamina info`` reports (found without importing them).
REPORTED_PACKAGES: tuple[str, ...] = (
    "lamina-core",
    "torch",
    "pluggy",
    "torch_xla",
    "torch_npu",
    "nvidia-ml-py",
    "triton",
)


def _vendor_versions(backend: Backend) -> dict[str, str]:
    try:
        return dict(backend.vendor_versions())
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _plugins(registry: PluginRegistry) -> list[dict[str, Any]]:
    return [
        {
            "name": r.name,
            "target": r.target,
            "distribution": r.distribution,
            "version": r.version,
            "status": r.status,
            "stage": r.stage,
            "error": r.error,
            "backends": list(r.backends),
        }
        for r in sorted(registry.records.values(), key=lambda r: r.name)
    ]


def collect_info(registry: PluginRegistry) -> dict[str, Any]:
    """The report as plain data (what ``--json`` prints).

    The host topology is found as ``lamina.init()`` finds it (plugins first, then the
    backend), so a topology plugin that fails here is listed among the plugins.
    """
    versions: dict[str, str | None] = {"python": platform.python_version()}
    versions.update({name: package_version(name) for name in REPORTED_PACKAGES})
    backends = [
        {
            "name": name,
            "plugin": entry.plugin,
            "priority": entry.backend.priority,
            "device_type": entry.backend.device_type,
            "collective_backend": entry.backend.collective_backend,
            "available": entry.availability.available,
            "reason": entry.availability.reason,
            "vendor_versions": _vendor_versions(entry.backend),
        }
        for name, entry in sorted(registry.backends.items())
    ]
    from lamina.strategies.codec_registry import codecs
    from lamina.strategies.registry import strategies

    report: dict[str, Any] = {
        "versions": versions,
        "plugins": _plugins(registry),
        "backends": backends,
        "strategies": [
            {"name": s.name, "summary": s.summary, "options": list(s.options.names())}
            for s in strategies(registry).values()
        ],
        "codecs": [
            {"name": c.name, "wire_dtype": str(c.wire_dtype).removeprefix("torch.")}
            for c in codecs(registry).values()
        ],
        "selected_backend": None,
        "selection_error": None,
        "devices": None,
        "graph_capture": None,
        "topology": None,
    }
    try:
        backend = registry.select_backend()
    except LaminaError as exc:
        report["selection_error"] = str(exc)
        return report
    report["selected_backend"] = backend.name
    handle = backend.handle()
    report["devices"] = {"type": backend.device_type, "count": handle.device_count()}
    reason = handle.graph_capture_reason()
    report["graph_capture"] = {"supported": not reason, "reason": reason}
    host = registry.discover_host(backend, 0, 1)
    report["topology"] = {
        "host": host.host,
        "numa_nodes": {str(k): v for k, v in sorted(host.numa_cpus.items())},
        "local_links": len(host.local_links),
        "fast_groups": [list(g) for g in host.fast_groups],
        "notes": list(host.notes),
    }
    report["job_topology"] = _job_topology(host.host)
    report["plugins"] = _plugins(registry)  # after discovery, which may fail a plugin
    return report


def _job_topology(host: str) -> dict[str, Any] | None:
    """This host's place in the topology ``$LAMINA_TOPOLOGY`` declares (e.g. one written by
    ``lamina topo probe``): its ranks and the links that touch it; None when none is set,
    ``{"error": ...}`` when the file cannot be used."""
    import os

    from lamina.session import PROBE, TOPOLOGY_ENV

    path = os.environ.get(TOPOLOGY_ENV)
    if not path or path == PROBE:
        return None
    from lamina.device.topology_file import load_topology

    try:
        topology = load_topology(path)
    except LaminaError as exc:
        return {"file": path, "error": str(exc)}
    host_of = {d.rank: d.host for d in topology.devices}
    mine = sorted(r for r, h in host_of.items() if h == host)
    links: dict[tuple[str, str], dict[str, Any]] = {}
    for link in topology.links:
        pair = tuple(sorted((host_of[link.a], host_of[link.b])))
        if host in pair and pair not in links:
            profile = link.profile
            links[pair] = {  # type: ignore[index]
                "hosts": list(pair),
                "kind": profile.kind,
                "bandwidth_gbps": profile.bandwidth_gbps,
                "latency_us": profile.latency_us,
                "source": profile.source,
            }
    return {
        "file": path,
        "world_size": topology.world_size,
        "hosts": len(set(host_of.values())),
        "ranks": mine,
        "links": list(links.values()),
    }


def render_info(report: dict[str, Any], console: Console) -> None:
    """Print the report as readable tables."""
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v is not None)
    console.print(f"[bold]lamina[/bold]  {versions}")

    plugins = Table(title="plugins", title_justify="left")
    for column in ("name", "distribution", "status", "backends", "error"):
        plugins.add_column(column)
    for p in report["plugins"]:
        status = "[green]loaded[/green]" if p["status"] == "loaded" else "[red]failed[/red]"
        error = f"{p['stage']}: {p['error']}" if p["error"] else ""
        dist = f"{p['distribution']} {p['version']}" if p["distribution"] else p["target"]
        plugins.add_row(p["name"], dist, status, ", ".join(p["backends"]), error)
    console.print(plugins)

    console.print("[bold]backends[/bold]")
    for b in report["backends"]:
        selected = " [bold](selected)[/bold]" if b["name"] == report["selected_backend"] else ""
        state = "available" if b["available"] else "unavailable"
        style = "green" if b["available"] else "yellow"
        reason = f" — {b['reason']}" if b["reason"] else ""
        vendor = ", ".join(f"{k} {v}" for k, v in b["vendor_versions"].items())
        console.print(
            f"  {b['name']}: [{style}]{state}[/{style}]{reason}{selected}\n"
            f"      priority {b['priority']}, device {b['device_type']}, "
            f"collectives {b['collective_backend']}" + (f", {vendor}" if vendor else ""),
            soft_wrap=True,
        )

    console.print("[bold]strategies[/bold] (lamina.distribute(model, NAME, **options))")
    for s in report["strategies"]:
        console.print(
            f"  {s['name']}: {s['summary']}\n      options: {', '.join(s['options'])}",
            soft_wrap=True,
        )
    listed = ", ".join(f"{c['name']} ({c['wire_dtype']})" for c in report["codecs"])
    console.print(f"[bold]codecs[/bold] (codec=NAME): {listed}", soft_wrap=True)

    if report["selection_error"]:
        console.print(f"[red]no backend selected:[/red] {report['selection_error']}")
        return
    devices = report["devices"]
    console.print(
        f"selected backend: [bold]{report['selected_backend']}[/bold] "
        f"({devices['count']} {devices['type']} device(s))"
    )
    capture = report["graph_capture"]
    shown = "supported" if capture["supported"] else f"not supported ({capture['reason']})"
    console.print(f"graph capture of a step (compile_step replays it): {shown}", soft_wrap=True)
    topo = report["topology"]
    numa = ", ".join(f"node{k}: {v}" for k, v in topo["numa_nodes"].items()) or "none reported"
    console.print(f"host {topo['host']}: NUMA {numa}; {topo['local_links']} local link(s)")
    for note in topo["notes"]:
        console.print(f"  note: {note}")
    job = report.get("job_topology")
    if job is None:
        return
    if "error" in job:
        console.print(f"job topology {job['file']}: [red]{job['error']}[/red]", soft_wrap=True)
        return
    console.print(
        f"job topology {job['file']}: {job['world_size']} rank(s) on {job['hosts']} host(s); "
        f"this host runs rank(s) {job['ranks']}",
        soft_wrap=True,
    )
    for link in job["links"]:
        mbit = link["bandwidth_gbps"] * 8e3
        console.print(
            f"  link {link['hosts'][0]} - {link['hosts'][1]}: {link['kind']}, "
            f"{mbit:,.1f} Mbit/s, {link['latency_us']:.1f} us ({link['source']})",
            soft_wrap=True,
        )
