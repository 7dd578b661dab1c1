"""``lamina topo probe`` and ``lamina topo place``: measure the links; place the ranks.

``place`` reads a topology file and prints the ring order that crosses each host's
uplink least (each host's ranks in a row), its bottleneck bandwidth against the ranks'
own order, and the cost model's predicted all-reduce times. ``probe``:

Launches this module on every rank with torchrun (through ``lamina run``'s launch
planning: under SLURM or ``lamina emulate`` it joins the job's rendezvous on every
host). Each rank joins the job, discovers its host, and the ranks measure one pair per
pair of hosts and one pair inside each host (:mod:`lamina.device.probe`); rank 0 prints
the links and writes the topology file, which ``LAMINA_TOPOLOGY=FILE`` (or
``lamina.init(topology=FILE)``) then uses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lamina.cli.run import add_nproc_argument
from lamina.errors import ConfigError

RANK_MODULE = "lamina.cli.topo"


def _size(text: str) -> int:
    from lamina.bench.sweep_options import parse_size

    return parse_size(text)


def probe_command(args: argparse.Namespace) -> int:
    """Check the options, then launch the probe on every rank."""
    from lamina.cli.run import launch_module

    nbytes = _size(args.bytes)
    if nbytes < 4 or args.iters < 1:
        raise ConfigError("--bytes must be at least 4 and --iters at least 1")
    output = Path(args.output).resolve()
    if not output.parent.is_dir():
        raise ConfigError(f"--output {args.output!r}: directory {output.parent} does not exist")
    forwarded = ["--bytes", str(nbytes), "--iters", str(args.iters), "--output", str(output)]
    return launch_module(RANK_MODULE, forwarded, args.nproc_per_node, args.backend)


def rank_main(argv: Sequence[str] | None = None) -> int:
    """What every rank runs: join, probe, rank 0 prints and writes the topology."""
    parser = argparse.ArgumentParser(prog=RANK_MODULE)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    import lamina
    from lamina.device.probe import link_rows, probe_topology
    from lamina.device.topology_file import save_topology

    with lamina.init() as rt:
        topology = probe_topology(
            rt.topology, rt.rank, nbytes=args.bytes, iters=args.iters, group=None
        )
        if rt.is_main:
            hosts = sorted({d.host for d in topology.devices})
            print(f"lamina topo probe: {rt.world_size} rank(s) on {len(hosts)} host(s)")
            print(
                f"{'host a':16}{'host b':16}{'kind':9}{'Mbit/s':>10}{'GB/s':>10}{'latency us':>12}"
            )
            for a, b, profile in link_rows(topology):
                mbit = profile.bandwidth_gbps * 8e3
                print(
                    f"{a:16}{b:16}{profile.kind:9}{mbit:10.1f}{profile.bandwidth_gbps:10.4f}"
                    f"{profile.latency_us:12.1f}"
                )
            save_topology(topology, args.output)
            print(f"wrote {args.output} (use it with LAMINA_TOPOLOGY={args.output})")
    return 0


def place_command(args: argparse.Namespace) -> int:
    """``lamina topo place``: the ring order with the widest bottleneck, and the gain."""
    from lamina.comm.cost import CostModel
    from lamina.comm.layout import HostLayout, best_ring, ring_bottleneck_gbps
    from lamina.device.topology_file import load_topology
    from lamina.units import format_bytes

    topology = load_topology(args.topology)
    nbytes = _size(args.bytes)
    layout = HostLayout.of(topology)
    current = layout.rank_order()
    best = best_ring(layout)
    model = CostModel.from_topology(topology)
    now_s = model.ring_all_reduce(current, nbytes)
    best_s = model.ring_all_reduce(best, nbytes)
    print(f"lamina topo place: {topology.summary()} ({args.topology})")
    for index, (name, ranks) in enumerate(zip(layout.names, layout.hosts, strict=True)):
        print(f"  host {index} {name}: ranks {list(ranks)}")
    rows = (("rank order now", current, now_s), ("topology order", best, best_s))
    print(f"{'ring':16}{'bottleneck GB/s':>17}{'crossings':>11}  all-reduce {format_bytes(nbytes)}")
    for label, order, seconds in rows:
        print(
            f"{label:16}{ring_bottleneck_gbps(topology, order):17.4g}"
            f"{layout.crossings(order):>11}  {seconds * 1e3:.2f} ms (model)"
        )
    print(f"order: {' '.join(map(str, best))}")
    if best == current:
        print("the ranks are already in topology order: nothing to gain")
    else:
        print(
            f"predicted gain: {now_s / best_s:.2f}x on a flat ring; launch the ranks host by "
            "host (srun --distribution=block) or let lamina's algorithms follow the hosts "
            "(DP's algorithm='auto' does)"
        )
    return 0


def add_topo_parser(subparsers: Any) -> None:
    """Register ``topo`` (with its ``probe`` and ``place`` subcommands) on the ``lamina``
    parsers."""
    topo = subparsers.add_parser("topo", help="measure the job's topology")
    kinds = topo.add_subparsers(dest="topo_command", required=True, metavar="COMMAND")
    probe = kinds.add_parser(
        "probe",
        help="measure bandwidth and latency between hosts and inside them; write a topology",
        description="Measure one rank pair per pair of hosts and one inside each host with "
        "send/recv, then write a topology file with the measured links.",
    )
    add_nproc_argument(probe)
    probe.add_argument("--backend", default=None, metavar="NAME", help="lamina backend")
    probe.add_argument("--bytes", default="8M", metavar="SIZE", help="bytes per transfer (8M)")
    probe.add_argument("--iters", type=int, default=3, metavar="N", help="timed transfers (3)")
    probe.add_argument("--output", default="topology.json", metavar="FILE", help="topology file")
    probe.set_defaults(func=probe_command)
    place = kinds.add_parser(
        "place",
        help="print the rank order whose ring crosses the slow links least, and the gain",
        description="Read a topology file (e.g. written by `lamina topo probe`) and print "
        "the ring order with the widest bottleneck, against the ranks' own order.",
    )
    place.add_argument("topology", metavar="TOPOLOGY", help="topology file (JSON)")
    place.add_argument("--bytes", default="64M", metavar="SIZE", help="all-reduce size (64M)")
    place.set_defaults(func=place_command)


if __name__ == "__main__":
    sys.exit(rank_main())
