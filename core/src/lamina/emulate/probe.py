"""Can this machine run ``lamina emulate``? Create and remove one real network namespace.

The emulator needs ``ip``, ``tc`` and ``unshare`` and the right to create network
namespaces: root is not enough in a container without ``CAP_SYS_ADMIN``, so the probe
tries rather than guesses. It runs ``ip netns add`` on a unique name, then ``ip netns
delete`` on it whatever happened, each bounded by :data:`PROBE_TIMEOUT_S`. ``.ci/run``
runs the same two commands in shell (it runs before anything is installed) and, when
they succeed, exports ``$LAMINA_REQUIRE_EMULATE=1``: the emulator's tests must then run,
and one that would skip fails instead, naming why (:func:`emulation_required`).

``python -m lamina.emulate.probe`` prints the verdict and exits 0 when the emulator can
run here, 1 when it cannot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

from lamina.errors import ConfigError

#: Set to 1 where the emulator can run (``.ci/run`` does, after the probe): its tests then
#: fail instead of skipping.
REQUIRE_ENV = "LAMINA_REQUIRE_EMULATE"
#: Name prefix of the probe's namespace (never one of the emulator's ``lamina-emu-``).
PROBE_PREFIX = "lamina-probe-"
#: Seconds each of the probe's commands may take.
PROBE_TIMEOUT_S = 10.0
TOOLS = ("ip", "tc", "unshare")


def probe_namespace_name() -> str:
    """A namespace name no other probe or emulator uses."""
    return f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _ip_netns(verb: str, namespace: str, timeout: float) -> str | None:
    """``ip netns <verb> <namespace>``: None when it worked, else what went wrong."""
    argv = ["ip", "netns", verb, namespace]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(argv)}` did not finish within {timeout:g} s"
    except OSError as exc:
        return f"`{' '.join(argv)}` could not start: {exc}"
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip() or "no message").splitlines()
        return f"`{' '.join(argv)}` failed (exit {result.returncode}): {' '.join(said)}"
    return None


def unavailable_reason(
    namespace: str | None = None, timeout: float = PROBE_TIMEOUT_S
) -> str | None:
    """None when the emulator can run here (its tools exist and a network namespace was
    created and removed); else one line saying what is missing or what failed."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"lamina emulate needs {', '.join(missing)} on PATH; install iproute2 / util-linux"
    name = namespace or probe_namespace_name()
    try:
        failed = _ip_netns("add", name, timeout)
    finally:  # always: a timed-out add may still have created it
        removed = _ip_netns("delete", name, timeout)
    if failed is not None:
        return (
            f"lamina emulate cannot create a network namespace here: {failed} (it needs root "
            "with CAP_SYS_ADMIN and CAP_NET_ADMIN)"
        )
    if removed is not None:
        return f"lamina emulate cannot remove a network namespace here: {removed}"
    return None


def emulation_required() -> bool:
    """Whether ``$LAMINA_REQUIRE_EMULATE`` says the emulator must run here (``1``)."""
    value = os.environ.get(REQUIRE_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ConfigError(
        f"{REQUIRE_ENV}={value!r} is not 0 or 1; set 1 where the emulator must run (its tests "
        "then fail instead of skipping), unset it otherwise"
    )


def main() -> int:
    """Print whether the emulator can run here; 0 when it can, 1 when it cannot."""
    reason = unavailable_reason()
    print(reason or "lamina emulate can run here (a network namespace was created and removed)")
    return 0 if reason is None else 1


if __name__ == "__main__":
    sys.exit(main())
