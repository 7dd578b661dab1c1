"""Faults injected into an emulated cluster: a host's link cut, or a host's processes killed.

``--fault cut:H`` takes host H's port on the switch down: from then on nothing crosses its
link in either direction, as when a cable or a switch port dies (its ranks' collectives
stall; lamina's watchdog, ``LAMINA_COLLECTIVE_TIMEOUT``, is what ends them).
``--fault kill:H`` SIGKILLs every process on host H, as when a node dies. The fault fires
``--fault-at S`` seconds after the hosts started, or when a task first prints a line
containing ``--fault-on TEXT`` (e.g. ``"step 3"``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from lamina.emulate.netns import EmulatedNetwork, remove_processes
from lamina.errors import ConfigError

FAULT_KINDS = ("cut", "kill")


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on host ``host``, at ``at_s`` seconds or on output ``on_text``."""

    kind: str
    host: int
    at_s: float | None = None
    on_text: str | None = None

    def describe(self) -> str:
        """``cut the link of host 1`` / ``kill every process on host 1``."""
        if self.kind == "cut":
            return f"cut the link of host {self.host}"
        return f"kill every process on host {self.host}"


def parse_fault(text: str, hosts: int, at_s: float | None, on_text: str | None) -> Fault:
    """``KIND:HOST`` with exactly one trigger (ConfigError naming what is wrong)."""
    kind, _, host = text.partition(":")
    if kind not in FAULT_KINDS or not host.isdigit():
        raise ConfigError(f"--fault {text!r} is not KIND:HOST; use cut:1 or kill:1")
    index = int(host)
    if index >= hosts:
        raise ConfigError(f"--fault {text!r}: there is no host {index} (hosts 0-{hosts - 1})")
    if (at_s is None) == (on_text is None):
        raise ConfigError(f"--fault {text!r} needs one trigger: --fault-at S or --fault-on TEXT")
    if at_s is not None and at_s < 0:
        raise ConfigError(f"--fault-at {at_s} must be >= 0 seconds")
    if on_text is not None and not on_text:
        raise ConfigError("--fault-on needs a non-empty text")
    return Fault(kind, index, at_s, on_text)


class FaultInjector:
    """Fires ``fault`` on ``network`` once its trigger comes; see the module docstring."""

    def __init__(self, fault: Fault, network: EmulatedNetwork, ranks: list[int]) -> None:
        self.fault = fault
        self.network = network
        self.ranks = ranks
        self.fired_at: float | None = None
        self._trigger = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        """Start waiting for the trigger (the hosts have started)."""
        self._thread.start()

    def saw(self, line: str) -> None:
        """A task printed ``line``: trigger on the fault's text."""
        if self.fault.on_text is not None and self.fault.on_text in line:
            self._trigger.set()

    def _run(self) -> None:
        if self.fault.at_s is not None:
            self._trigger.wait(self.fault.at_s)
        else:
            self._trigger.wait()
        self.fire()

    def fire(self) -> None:
        """Apply the fault now."""
        if self.fired_at is not None:
            return
        host = self.network.hosts[self.fault.host]
        if self.fault.kind == "cut":
            port = f"h{host.index}"
            subprocess.run(
                ["ip", "-n", self.network.switch, "link", "set", port, "down"],
                capture_output=True,
                check=False,
            )
        else:
            remove_processes(host.namespace)
        self.fired_at = time.monotonic()
        print(
            f"lamina emulate: fault: {self.fault.describe()} ({host.hostname}, ranks {self.ranks})",
            file=sys.stderr,
            flush=True,
        )
