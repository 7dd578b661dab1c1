"""Real installed distributions for tests: a module plus dist-info with ``lamina`` entry
points, on a folder that a subprocess puts on ``PYTHONPATH``."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install_fake_distribution(site: Path, dist: str, module: str, source: str) -> None:
    """Write ``module.py`` (``source``, dedented) and ``<dist>-0.1.dist-info`` into ``site``,
    with the entry point ``[lamina] <dist> = <module>``."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[lamina]\n{dist} = {module}\n")
