"""The emulated cluster's network: one namespace per host, joined through a bridge.

Each host is a network namespace ``lamina-emu-<pid>-h<k>`` with a loopback (its ranks
talk over it, unshaped, as on one machine) and one veth ``eth0`` with address
``198.18.0.<k+1>/24`` (198.18.0.0/15 is reserved for benchmarking; these addresses exist
only inside the namespaces). The other end of every veth sits on a bridge in a switch
namespace ``lamina-emu-<pid>-sw``. Both ends are shaped with tc: the host's ``eth0``
egress is its upload, the switch port's egress its download. ``/etc/netns/<ns>/hosts``
(which ``ip netns exec`` mounts over ``/etc/hosts``) names every host, so host names
resolve as on a cluster; each host also gets its own host name through a UTS namespace.

``<pid>`` is the emulator's process id: namespaces whose process is gone (an emulator
killed with ``kill -9``) are removed, with every process still inside them, by the next
emulator that starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lamina.emulate.links import LinkSpec
from lamina.errors import ConfigError

PREFIX = "lamina-emu-"
NETNS_ETC = Path("/etc/netns")
#: Host k's address (k < 250): ``SUBNET_PREFIX + str(k + 1)``.
SUBNET_PREFIX = "198.18.0."
MAX_HOSTS = 250


def hostname_of(index: int) -> str:
    """The host name of emulated host ``index``."""
    return f"lamina-h{index}"


@dataclass(frozen=True)
class EmulatedHost:
    """One emulated host: its namespace, host name and address."""

    index: int
    namespace: str
    hostname: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Argv prefix that runs a command inside this host (its network and host name)."""
        return [
            "ip", "netns", "exec", self.namespace,
            "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname,
        ]  # fmt: skip


def _run(argv: Sequence[str]) -> None:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if result.returncode != 0 and "netem" in argv and "qdisc kind is unknown" in result.stderr:
        raise ConfigError(
            "this kernel has no netem qdisc (sch_netem), which --link delay= and loss= need; "
            "drop them (the rate alone needs only tbf) or load the module"
        )
    if result.returncode != 0:
        raise ConfigError(
            f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.stdout.strip()}; "
            "lamina emulate needs root, iproute2 and the veth, bridge, tbf and netem kernel "
            "modules"
        )


def check_privileges() -> None:
    """ConfigError unless this process can create network namespaces."""
    if os.geteuid() != 0:
        raise ConfigError(
            "lamina emulate needs root (it creates network namespaces); run it as root or "
            "in a container with CAP_NET_ADMIN and CAP_SYS_ADMIN"
        )
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise ConfigError(
                f"lamina emulate needs `{tool}` on PATH; install iproute2 / util-linux"
            )


def _namespaces() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_processes(namespace: str) -> None:
    """SIGKILL every process in ``namespace``."""
    result = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    )
    for token in result.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(token), signal.SIGKILL)


def remove_namespace(namespace: str) -> None:
    """Kill what runs in ``namespace``, delete it and its ``/etc/netns`` files."""
    remove_processes(namespace)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
    shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)


def ours() -> list[str]:
    """Namespaces of every emulator (this one's and stale ones)."""
    return [n for n in _namespaces() if n.startswith(PREFIX)]


def remove_stale() -> list[str]:
    """Remove the namespaces of emulators that no longer run; their names."""
    stale: list[str] = []
    for namespace in ours():
        owner = namespace[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            remove_namespace(namespace)
            stale.append(namespace)
    if NETNS_ETC.is_dir():
        live = set(_namespaces())
        for leftover in NETNS_ETC.glob(PREFIX + "*"):
            owner = leftover.name[len(PREFIX) :].split("-", 1)[0]
            if leftover.name not in live and owner.isdigit() and not _alive(int(owner)):
                shutil.rmtree(leftover, ignore_errors=True)
    return stale


class EmulatedNetwork:
    """``hosts`` namespaces joined by a bridge, each uplink shaped as ``link`` (see the
    module docstring). ``up()`` builds it (tearing down what it built if a step fails);
    ``down()`` removes everything and is safe to call twice."""

    def __init__(self, hosts: int, link: LinkSpec, owner: int | None = None) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ConfigError(f"--hosts {hosts} is out of range; use 1-{MAX_HOSTS}")
        self.link = link
        owner = os.getpid() if owner is None else owner
        self.switch = f"{PREFIX}{owner}-sw"
        self.hosts = [
            EmulatedHost(k, f"{PREFIX}{owner}-h{k}", hostname_of(k), SUBNET_PREFIX + str(k + 1))
            for k in range(hosts)
        ]
        self._created: list[str] = []

    def up(self) -> None:
        """Create the switch, the hosts, their links, shaping and host files."""
        try:
            self._add_namespace(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            # IPv4 and the IPv4-mapped IPv6 form (torch's stores listen dual-stack and look
            # their peers up by that form)
            hosts_file = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
                f"{h.address} {h.hostname}\n::ffff:{h.address} {h.hostname}\n" for h in self.hosts
            )
            for host in self.hosts:
                self._add_host(host, hosts_file)
        except BaseException:
            self.down()
            raise

    def _add_namespace(self, namespace: str) -> None:
        _run(["ip", "netns", "add", namespace])
        self._created.append(namespace)
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _add_host(self, host: EmulatedHost, hosts_file: str) -> None:
        ns, port = host.namespace, f"h{host.index}"
        self._add_namespace(ns)
        _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
              "netns", self.switch])  # fmt: skip
        _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", self.switch, "link", "set", port, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        for command in self.link.qdisc_commands("eth0"):  # upload
            _run(["ip", "netns", "exec", ns, *command])
        for command in self.link.qdisc_commands(port):  # download
            _run(["ip", "netns", "exec", self.switch, *command])
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file)
        (etc / "hostname").write_text(host.hostname + "\n")

    def down(self) -> None:
        """Kill every process in the hosts, delete the namespaces and host files."""
        for namespace in reversed(self._created):
            remove_namespace(namespace)
        self._created = []
