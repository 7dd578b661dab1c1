"""The build backend adds lamina_npu_autoload.pth to a wheel and lists it in RECORD."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def build() -> ModuleType:
    pytest.importorskip("setuptools.build_meta", reason="setuptools is not installed")
    return _load("lamina_npu_build", ROOT / "_packaging" / "lamina_npu_build.py")


def test_pth_line_matches_the_guard(build: ModuleType) -> None:
    guard = _load("_guard_under_test", ROOT / "src" / "lamina_npu_autoload_guard.py")
    assert build.PTH_LINE == guard.PTH_LINE
    assert build.PTH_LINE.startswith("import ")  # site.py executes only such lines


def test_add_pth_updates_record(build: ModuleType, tmp_path: Path) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("demo.py", "x = 1\n")
        zf.writestr(
            "demo-1.0.dist-info/RECORD", "demo.py,sha256=abc,6\ndemo-1.0.dist-info/RECORD,,\n"
        )
    build.add_pth(str(wheel))
    build.add_pth(str(wheel))  # idempotent
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        payload = zf.read(build.PTH_NAME)
        record = zf.read("demo-1.0.dist-info/RECORD").decode()
    assert names.count(build.PTH_NAME) == 1
    assert payload.decode() == build.PTH_LINE
    digest = base64.urlsafe_b64encode(hashlib.sha256(payload).digest()).rstrip(b"=").decode()
    assert f"{build.PTH_NAME},sha256={digest},{len(payload)}" in record.splitlines()
    assert sum(line.startswith(build.PTH_NAME + ",") for line in record.splitlines()) == 1
    assert "demo.py,sha256=abc,6" in record
