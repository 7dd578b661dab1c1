"""The interpreter-start guard, run for real: a site folder holding lamina_npu_autoload.pth.

Each case starts ``python -S`` (no real site-packages) with the package sources on
PYTHONPATH, adds a temporary site folder with ``site.addsitedir`` - which executes the
``.pth`` exactly as at start-up - and reports what the guard left in the environment. The
toolkit is simulated with real files on disk (empty ``libhccl.so`` / ``libascendcl.so``
in a CANN-shaped folder); torch_npu with a package that raises if anything imports it.
These tests need neither torch_npu nor an installed lamina-backend-npu.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
DISABLED = "LAMINA_NPU_AUTOLOAD_DISABLED"

_REPORT = (
    "import json, os, site, sys; site.addsitedir(sys.argv[1]); "
    "import lamina_npu_autoload_guard as g; "
    "print(json.dumps({k: os.environ.get(k) for k in (g.AUTOLOAD_ENV, g.DISABLED_ENV)}))"
)


def _pth_line() -> str:
    namespace: dict[str, Any] = {}
    guard_source = (SRC / "lamina_npu_autoload_guard.py").read_text(encoding="utf-8")
    exec(compile(guard_source, "lamina_npu_autoload_guard.py", "exec"), namespace)
    line: str = namespace["PTH_LINE"]
    return line


def _site(tmp_path: Path, torch_npu: bool) -> Path:
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / "lamina_npu_autoload.pth").write_text(_pth_line(), encoding="utf-8")
    if torch_npu:
        package = site / "torch_npu"
        package.mkdir()
        (package / "__init__.py").write_text(
            'raise RuntimeError("the guard must not import torch_npu")\n', encoding="utf-8"
        )
    return site


def _toolkit(tmp_path: Path, libraries: tuple[str, ...]) -> Path:
    """A CANN-shaped install: Ascend/ascend-toolkit/{set_env.sh, latest/lib64/<libraries>}."""
    base = tmp_path / "Ascend" / "ascend-toolkit"
    lib64 = base / "latest" / "lib64"
    lib64.mkdir(parents=True)
    (base / "set_env.sh").write_text("# sets LD_LIBRARY_PATH\n", encoding="utf-8")
    for name in libraries:
        (lib64 / name).write_bytes(b"")
    return base / "latest"


def _run(
    site: Path, env: dict[str, str], pythonpath: tuple[Path, ...] = (SRC,)
) -> dict[str, str | None]:
    full_env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(site.parent / "home"),
        "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath),
        **env,
    }
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _REPORT, str(site)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # site.py reports a failing .pth line on stderr
    report: dict[str, str | None] = json.loads(proc.stdout)
    return report


def _machine_has_cann(tmp_path: Path) -> bool:
    code = (
        "import sys; from lamina_npu.cann import probe_cann; "
        "p = probe_cann({'HOME': sys.argv[1]}); print(int(p.usable or bool(p.toolkit_root)))"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code, str(tmp_path)],
        env={"PYTHONPATH": str(SRC), "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout.strip() == "1"


@pytest.fixture
def no_system_cann(tmp_path: Path) -> None:
    if _machine_has_cann(tmp_path):
        pytest.skip("this machine has a CANN toolkit installed: the 'absent' cases cannot hold")


def test_does_nothing_without_torch_npu(tmp_path: Path) -> None:
    site = _site(tmp_path, torch_npu=False)
    assert _run(site, {}) == {AUTOLOAD: None, DISABLED: None}


@pytest.mark.usefixtures("no_system_cann")
def test_disables_autoload_when_toolkit_is_missing(tmp_path: Path) -> None:
    site = _site(tmp_path, torch_npu=True)
    report = _run(site, {})
    assert report[AUTOLOAD] == "0"
    reason = report[DISABLED] or ""
    assert "libhccl.so" in reason
    assert "install the Ascend CANN toolkit" in reason and "set_env.sh" in reason


def test_does_nothing_when_toolkit_is_sourced(tmp_path: Path) -> None:
    site = _site(tmp_path, torch_npu=True)
    root = _toolkit(tmp_path, ("libhccl.so", "libascendcl.so"))
    env = {"ASCEND_HOME_PATH": str(root), "LD_LIBRARY_PATH": str(root / "lib64")}
    assert _run(site, env) == {AUTOLOAD: None, DISABLED: None}


@pytest.mark.usefixtures("no_system_cann")
def test_installed_but_not_sourced_names_the_script(tmp_path: Path) -> None:
    site = _site(tmp_path, torch_npu=True)
    root = _toolkit(tmp_path, ("libhccl.so", "libascendcl.so"))
    report = _run(site, {"ASCEND_HOME_PATH": str(root)})
    assert report[AUTOLOAD] == "0"
    reason = report[DISABLED] or ""
    assert str(root / "lib64" / "libhccl.so") in reason
    assert f"source {root.parent / 'set_env.sh'}" in reason


@pytest.mark.usefixtures("no_system_cann")
def test_names_the_library_still_missing(tmp_path: Path) -> None:
    site = _site(tmp_path, torch_npu=True)
    lib_dir = tmp_path / "only-hccl"
    lib_dir.mkdir()
    (lib_dir / "libhccl.so").write_bytes(b"")
    report = _run(site, {"LD_LIBRARY_PATH": str(lib_dir)})
    assert report[AUTOLOAD] == "0"
    reason = report[DISABLED] or ""
    assert reason.startswith("libascendcl.so not found"), reason


def test_respects_an_explicit_autoload_setting(tmp_path: Path) -> None:
    site = _site(tmp_path, torch_npu=True)
    assert _run(site, {AUTOLOAD: "1"}) == {AUTOLOAD: "1", DISABLED: None}


def test_never_raises(tmp_path: Path) -> None:
    """A broken probe (here: a lamina_npu.cann that raises) leaves start-up untouched."""
    site = _site(tmp_path, torch_npu=True)
    shadow = tmp_path / "shadow"
    (shadow / "lamina_npu").mkdir(parents=True)
    (shadow / "lamina_npu" / "__init__.py").write_text("", encoding="utf-8")
    (shadow / "lamina_npu" / "cann.py").write_text(
        'raise OSError("simulated failure")\n', encoding="utf-8"
    )
    report = _run(site, {}, pythonpath=(shadow, SRC))
    assert report == {AUTOLOAD: None, DISABLED: None}
