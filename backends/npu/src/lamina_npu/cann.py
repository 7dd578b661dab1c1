"""Find the Ascend CANN toolkit without importing torch_npu (standard library only).

torch_npu's extension module links directly against CANN libraries (``libhccl.so`` first,
then ``libascendcl.so`` and others) and its RPATH names only its own folders, so the
dynamic loader must find them on its normal search path: ``LD_LIBRARY_PATH`` (which the
toolkit's ``set_env.sh`` sets), the folders listed in ``/etc/ld.so.conf``, or the system
library folders. A toolkit that is installed but not on that path (``set_env.sh`` not
sourced) is as unusable as a missing one, and is reported with the script to source.

The interpreter-start guard (:mod:`lamina_npu_autoload_guard`) imports this module, so it
must stay standard-library only, cheap and free of side effects.
"""

from __future__ import annotations

import os
import sys

#: ``typing.TYPE_CHECKING`` without importing typing or collections at interpreter start.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "REQUIRED_LIBRARIES",
    "CannProbe",
    "find_library",
    "loader_dirs",
    "probe_cann",
    "toolkit_roots",
    "torch_npu_installed",
]

#: CANN libraries torch_npu's extension needs, in the order the loader reports them missing.
REQUIRED_LIBRARIES: tuple[str, ...] = ("libhccl.so", "libascendcl.so")

#: Variables that ``set_env.sh`` sets to the toolkit's install folder.
HOME_ENVS: tuple[str, ...] = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")

#: Written by the CANN installer; its ``Install_Path=`` line names the install base.
INSTALL_INFO = "/etc/Ascend/ascend_cann_install.info"

#: Toolkit folders under an install base: CANN >= 8.5 (``cann``), older toolkits, the engine.
TOOLKIT_SUBDIRS: tuple[str, ...] = ("cann", "ascend-toolkit/latest", "nnae/latest")

#: Library folders under a toolkit root.
LIBRARY_SUBDIRS: tuple[str, ...] = ("lib64", "hccl/lib64", "runtime/lib64")

_DEFAULT_SCRIPT = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def torch_npu_installed() -> bool:
    """True when ``torch_npu`` can be found on ``sys.path`` (it is not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def _ld_so_conf_dirs(path: str, depth: int = 0) -> list[str]:
    """Folders listed in an ld.so.conf file, following ``include`` globs."""
    if depth > 4:
        return []
    try:
        with open(path, encoding="utf-8", errors="replace") as conf:
            lines = conf.read().splitlines()
    except OSError:
        return []
    dirs: list[str] = []
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("hwcap "):
            continue
        if line.startswith("include "):
            pattern = line[len("include ") :].strip()
            if not os.path.isabs(pattern):
                pattern = os.path.join(os.path.dirname(path), pattern)
            for included in _expand(pattern):
                dirs.extend(_ld_so_conf_dirs(included, depth + 1))
        else:
            dirs.append(line)
    return dirs


def _expand(pattern: str) -> list[str]:
    """Files matching an ld.so.conf ``include`` pattern, sorted.

    The usual ``folder/*.conf`` is matched with ``os.listdir`` (this runs at interpreter
    start, where importing ``glob`` and ``re`` would cost more than the whole probe).
    """
    folder, name = os.path.split(pattern)
    if name.startswith("*") and not any(c in folder + name[1:] for c in "*?["):
        try:
            entries = os.listdir(folder)
        except OSError:
            return []
        return sorted(os.path.join(folder, e) for e in entries if e.endswith(name[1:]))
    import glob

    return sorted(glob.glob(pattern))


def _system_dirs() -> list[str]:
    multiarch = getattr(sys.implementation, "_multiarch", "") or ""
    arch_dirs = [f"/lib/{multiarch}", f"/usr/lib/{multiarch}"] if multiarch else []
    return [*arch_dirs, "/lib64", "/usr/lib64", "/lib", "/usr/lib"]


def loader_dirs(environ: Mapping[str, str], ld_so_conf: str = "/etc/ld.so.conf") -> list[str]:
    """The folders the dynamic loader searches: LD_LIBRARY_PATH, ld.so.conf, system folders.

    An approximation of ld.so's order (it reads a cache built from ld.so.conf); good enough
    to tell whether a library can be found at all.
    """
    entries = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    entries += _ld_so_conf_dirs(ld_so_conf)
    entries += _system_dirs()
    return list(dict.fromkeys(os.path.normpath(d) for d in entries))


def find_library(name: str, dirs: Sequence[str]) -> str | None:
    """The first ``dir/name`` among ``dirs`` that is a file (following links), else None."""
    for folder in dirs:
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate):
            return candidate
    return None


def _install_bases(environ: Mapping[str, str], install_info: str) -> list[str]:
    bases: list[str] = []
    try:
        with open(install_info, encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition("=")
                if key.strip() == "Install_Path" and value.strip():
                    bases.append(value.strip())
    except OSError:
        pass
    bases.append("/usr/local/Ascend")
    home = environ.get("HOME")
    if home:
        bases.append(os.path.join(home, "Ascend"))
    return bases


def toolkit_roots(environ: Mapping[str, str], install_info: str = INSTALL_INFO) -> list[str]:
    """Existing toolkit folders: ``$ASCEND_HOME_PATH``, ``$ASCEND_TOOLKIT_HOME``, defaults."""
    candidates = [environ[name] for name in HOME_ENVS if environ.get(name)]
    for base in _install_bases(environ, install_info):
        candidates.extend(os.path.join(base, sub) for sub in TOOLKIT_SUBDIRS)
    roots = (os.path.normpath(c) for c in candidates)
    return [r for r in dict.fromkeys(roots) if os.path.isdir(r)]


def _set_env_script(root: str) -> str | None:
    for folder in (root, os.path.dirname(root)):
        script = os.path.join(folder, "set_env.sh")
        if os.path.isfile(script):
            return script
    return None


class CannProbe:
    """What was found of the CANN toolkit, and why it cannot be used when it cannot.

    A plain class rather than a dataclass: this module runs at interpreter start, where
    importing :mod:`dataclasses` would dominate its cost.
    """

    __slots__ = ("found", "installed_at", "missing", "set_env", "toolkit_root")

    def __init__(
        self,
        found: dict[str, str],
        missing: tuple[str, ...],
        installed_at: dict[str, str],
        toolkit_root: str | None,
        set_env: str | None,
    ) -> None:
        #: Required library -> path, for those the dynamic loader can find.
        self.found = found
        #: Required libraries the dynamic loader cannot find.
        self.missing = missing
        #: Missing library -> where it is installed but off the loader's search path.
        self.installed_at = installed_at
        #: The toolkit folder that holds the libraries, when one was found.
        self.toolkit_root = toolkit_root
        #: The ``set_env.sh`` that puts the toolkit on the search path, when found.
        self.set_env = set_env

    def __repr__(self) -> str:
        return (
            f"CannProbe(found={self.found!r}, missing={self.missing!r}, "
            f"installed_at={self.installed_at!r}, toolkit_root={self.toolkit_root!r}, "
            f"set_env={self.set_env!r})"
        )

    @property
    def usable(self) -> bool:
        """True when every required library is on the loader's search path."""
        return not self.missing

    def reason(self) -> str:
        """One line naming the missing library and the fix (empty when usable)."""
        if self.usable:
            return ""
        first = self.missing[0]
        names = " and ".join(self.missing)
        if first in self.installed_at:
            script = self.set_env or os.path.join(str(self.toolkit_root), "set_env.sh")
            return (
                f"{first} (Ascend CANN toolkit) is installed at {self.installed_at[first]} but "
                f"is not on the library search path: run `source {script}` before starting Python"
            )
        return (
            f"{names} not found on the library search path nor in a CANN install folder: "
            "install the Ascend CANN toolkit and source its set_env.sh "
            f"(default: {_DEFAULT_SCRIPT})"
        )


def probe_cann(
    environ: Mapping[str, str] | None = None,
    *,
    ld_so_conf: str = "/etc/ld.so.conf",
    install_info: str = INSTALL_INFO,
) -> CannProbe:
    """Look for the CANN libraries torch_npu needs, on disk only (nothing is loaded)."""
    env = os.environ if environ is None else environ
    dirs = loader_dirs(env, ld_so_conf)
    found: dict[str, str] = {}
    missing: list[str] = []
    for name in REQUIRED_LIBRARIES:
        path = find_library(name, dirs)
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    installed_at: dict[str, str] = {}
    toolkit_root: str | None = None
    for root in toolkit_roots(env, install_info):
        lib_dirs = [os.path.join(root, sub) for sub in LIBRARY_SUBDIRS]
        hits = {name: find_library(name, lib_dirs) for name in REQUIRED_LIBRARIES}
        if any(hits.values()):
            toolkit_root = root
            installed_at = {n: p for n, p in hits.items() if p is not None and n in missing}
            break
    script = _set_env_script(toolkit_root) if toolkit_root else None
    return CannProbe(found, tuple(missing), installed_at, toolkit_root, script)
