"""Interpreter-start guard: keep ``import torch`` working when torch_npu cannot load.

torch_npu registers itself in torch's ``torch.backends`` entry-point group, and
``import torch`` imports every such backend unless ``TORCH_DEVICE_BACKEND_AUTOLOAD`` is
``0``. Without the Ascend CANN toolkit the import of torch_npu fails (``libhccl.so: cannot
open shared object file``) and torch turns that into a ``RuntimeError``: plain ``import
torch`` - and so every lamina command - crashes.

lamina-backend-npu installs ``lamina_npu_autoload.pth`` into site-packages; its one line
calls :func:`run` when the interpreter starts. When torch_npu is installed and the CANN
libraries are not on the library search path, :func:`run` sets
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (unless the variable is already set: an explicit choice
is respected) and records why in ``LAMINA_NPU_AUTOLOAD_DISABLED``. It does nothing when
torch_npu is absent or the toolkit is usable, never imports torch, and never raises.
Child processes inherit both variables.
"""

from __future__ import annotations

import os
import sys

#: ``typing.TYPE_CHECKING`` without importing typing (or collections) at interpreter start.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import MutableMapping

__all__ = ["AUTOLOAD_ENV", "DISABLED_ENV", "PTH_LINE", "decide", "run"]

#: torch reads this at ``import torch``; autoload of device backends runs only when it is "1".
AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"

#: Set by the guard to the reason it disabled autoload (shown by ``lamina info``).
DISABLED_ENV = "LAMINA_NPU_AUTOLOAD_DISABLED"


#: The line of ``lamina_npu_autoload.pth`` (written by the build backend in _packaging/);
#: site.py executes .pth lines that start with ``import``.
PTH_LINE = "import lamina_npu_autoload_guard; lamina_npu_autoload_guard.run()\n"


def _findable(name: str) -> bool:
    """Whether top-level module ``name`` can be imported, asking the finders directly.

    What ``importlib.util.find_spec`` does for a top-level name, without importing
    ``importlib.util`` in every interpreter (nothing is imported or executed).
    """
    if name in sys.modules:
        return True
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            if find_spec(name, None) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def decide(environ: MutableMapping[str, str]) -> str | None:
    """Disable torch's backend autoload in ``environ`` when torch_npu cannot load.

    Returns the reason when it did, else None. Imports only the standard library and
    :mod:`lamina_npu.cann` (itself standard-library only), and that only when torch_npu
    is installed.
    """
    if AUTOLOAD_ENV in environ or not _findable("torch_npu"):
        return None
    from lamina_npu.cann import probe_cann

    probe = probe_cann(environ)
    if probe.usable:
        return None
    reason = probe.reason()
    environ[AUTOLOAD_ENV] = "0"
    environ[DISABLED_ENV] = reason
    return reason


def run() -> None:
    """Entry point of ``lamina_npu_autoload.pth``: apply :func:`decide` to ``os.environ``."""
    try:
        decide(os.environ)
    except Exception:  # a start-up hook must never break the interpreter
        return
