"""Render the backend template shipped with lamina-core into a new package folder."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from lamina.errors import ConfigError
from lamina.scaffold.names import BackendNames

__all__ = ["TEMPLATE_DIR", "TEMPLATE_SUFFIX", "render_files", "write_backend_package"]

#: Every template file ends with this; the rendered file drops it.
TEMPLATE_SUFFIX = ".tmpl"
_LEFTOVER = re.compile(r"\{\{\s*\w+\s*\}\}")


#: The template, installed beside this module as package data of lamina-core.
TEMPLATE_DIR = Path(__file__).parent / "backend_template"


def _template_files() -> list[tuple[PurePosixPath, Path]]:
    """(path in the new package, template file) for every ``*.tmpl`` file."""
    return [
        (PurePosixPath(*source.relative_to(TEMPLATE_DIR).parts).with_suffix(""), source)
        for source in TEMPLATE_DIR.rglob(f"*{TEMPLATE_SUFFIX}")
        if source.is_file()
    ]


def _fill(text: str, names: BackendNames, where: str) -> str:
    for placeholder, value in names.placeholders().items():
        text = text.replace(placeholder, value)
    leftover = _LEFTOVER.search(text)
    if leftover:
        raise ConfigError(f"backend template {where} has an unknown placeholder {leftover[0]}")
    return text


def render_files(names: BackendNames) -> dict[PurePosixPath, bytes]:
    """The new package's files (path relative to its folder -> contents), sorted by path."""
    rendered: dict[PurePosixPath, bytes] = {}
    for path, source in _template_files():
        target = PurePosixPath(_fill(str(path), names, str(path)))
        rendered[target] = _fill(source.read_text(encoding="utf-8"), names, str(path)).encode()
    return dict(sorted(rendered.items()))


def write_backend_package(names: BackendNames, folder: Path) -> list[PurePosixPath]:
    """Create ``folder`` holding the backend package for ``names``; returns the files written.

    Never overwrites: an existing ``folder`` (even an empty one) is an error.
    """
    if folder.exists():
        raise ConfigError(
            f"{folder} already exists and lamina plugin new never overwrites; remove it or "
            "pass --dir with a new folder"
        )
    rendered = render_files(names)
    folder.mkdir(parents=True)
    for path, content in rendered.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(content)
    return list(rendered)
