"""In-tree PEP 517 build backend: setuptools, plus the start-up ``.pth`` in every wheel.

A ``.pth`` file only runs when it sits directly in a site-packages folder. setuptools has
no option that puts a file there for both regular and editable (PEP 660) installs:
``data_files`` lands under the environment prefix, and editable wheels leave out
``build_py`` outputs. So this backend lets setuptools build the wheel, then adds
``lamina_npu_autoload.pth`` at the wheel's root and lists it in ``RECORD``; pip installs
it beside the package and removes it on uninstall, in both modes.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import zipfile
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # re-exported PEP 517 hooks
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

#: The file name and its single line; site.py executes lines that start with "import".
PTH_NAME = "lamina_npu_autoload.pth"
PTH_LINE = "import lamina_npu_autoload_guard; lamina_npu_autoload_guard.run()\n"


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def add_pth(wheel_path: str, name: str = PTH_NAME, line: str = PTH_LINE) -> None:
    """Rewrite ``wheel_path`` with ``name`` at its root, listed in the dist-info ``RECORD``."""
    payload = line.encode("utf-8")
    with zipfile.ZipFile(wheel_path) as source:
        items = [(info, source.read(info)) for info in source.infolist()]
    records = [info.filename for info, _ in items if info.filename.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise RuntimeError(f"{wheel_path}: expected one dist-info/RECORD, found {records}")
    entry = f"{name},{_record_hash(payload)},{len(payload)}\n"
    fd, tmp = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(wheel_path))
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as target:
            target.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), payload)
            for info, data in items:
                if info.filename == name:
                    continue
                if info.filename == records[0]:
                    lines = data.decode("utf-8").splitlines(True)
                    kept = [ln for ln in lines if not ln.startswith(name + ",")]
                    data = (entry + "".join(kept)).encode("utf-8")
                target.writestr(info, data)
        os.replace(tmp, wheel_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    """setuptools' wheel plus the start-up ``.pth``."""
    name: str = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    """setuptools' editable wheel plus the start-up ``.pth``."""
    name: str = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    add_pth(os.path.join(wheel_directory, name))
    return name
